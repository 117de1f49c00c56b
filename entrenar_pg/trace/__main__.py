"""``python -m entrenar_pg.trace``."""

import sys

from .cli import main

sys.exit(main())
