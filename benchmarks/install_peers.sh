#!/usr/bin/env bash
# Install DeepSpeed 0.19.8, the benchmark's same-host shared-memory peer, beside
# torch 2.13.0 (CPU) without letting pip replace torch, and build its CPU comm op.
#
# A benchmark peer only: not a runtime or a test dependency of entrenar.
# Idempotent: a second run finds everything in place and says so.
#   bash benchmarks/install_peers.sh
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
constraints="$here/peers-constraints.txt"
want_ds="0.19.8"
torch_before="$(python -c 'import torch; print(torch.__version__)')"
echo "[peers] torch before: $torch_before"

have_ds="$(python -c 'import importlib.metadata as m; print(m.version("deepspeed"))' 2>/dev/null || true)"
if [ "$have_ds" = "$want_ds" ]; then
    echo "[peers] deepspeed $want_ds already installed: nothing to install"
else
    echo "[peers] installing deepspeed==$want_ds (found: ${have_ds:-none}), torch pinned by $constraints"
    # DeepSpeed's setup.py imports torch: --no-build-isolation lets it see the
    # installed one instead of pulling a fresh torch into a build environment.
    # Its build dependencies come first, under the same constraints.
    python -m pip install -c "$constraints" ninja py-cpuinfo hjson msgpack psutil pydantic packaging
    DS_ACCELERATOR=cpu DS_BUILD_OPS=0 \
        python -m pip install --no-build-isolation -c "$constraints" "deepspeed==$want_ds"
fi

# Build (or find already built) the CPU shared-memory comm op (csrc/cpu/comm/shm.cpp).
# DeepSpeed compiles it with ninja + the system gcc into torch's extension cache
# the first time it is loaded; doing it here keeps the compile out of a timed run.
DS_ACCELERATOR=cpu python - <<'PY'
import time
from deepspeed.accelerator import get_accelerator
acc = get_accelerator()
print(f"[peers] deepspeed accelerator: {acc._name}")
t0 = time.time()
builder = acc.create_op_builder("ShareMemCommBuilder")
if builder is None:
    raise SystemExit("[peers] this DeepSpeed has no ShareMemCommBuilder for the CPU accelerator")
mod = builder.load()
print(f"[peers] CPU SHM comm op ready: {mod.__file__} ({time.time() - t0:.1f} s)")
PY

torch_after="$(python -c 'import torch; print(torch.__version__)')"
echo "[peers] torch after: $torch_after"
if [ "$torch_after" != "$torch_before" ]; then
    echo "[peers] ERROR: torch changed from $torch_before to $torch_after" >&2
    exit 1
fi
python -m pip list 2>/dev/null | grep -iE '^(torch|deepspeed) ' || true
