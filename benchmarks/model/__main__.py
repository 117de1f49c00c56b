"""``python -m benchmarks.model``: the cost model's command line (``cli.py``)."""

from benchmarks.model.cli import main

raise SystemExit(main())
