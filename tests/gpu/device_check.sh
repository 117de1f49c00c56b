#!/usr/bin/env bash
# Every GPU check in one pass (tests/gpu/README.md): what a session that is lent
# a GPU machine runs there, with that machine's own CUDA torch (never the
# pinned CPU build). Logs go to $OUT (default /tmp/entrenar-gpu).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-/tmp/entrenar-gpu}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 PYTHONPATH="$PWD"
PY="${PYTHON:-python3}"
TORCHRUN=("$PY" -m torch.distributed.run --standalone --nproc_per_node=2)
{
    nvidia-smi -L
    "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"
} 2>&1 | tee "$OUT/machine.txt"
# --no-deps: keep the machine's CUDA torch; registers the torch.backends entry point.
"$PY" -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -n 2

echo "== 1. tests: tests/gpu, and the CPU files that hold a CUDA case"
timeout 300 "$PY" -m pytest -p no:cacheprovider -n 4 -rs --durations 15 \
    --junitxml "$OUT/junit.xml" tests/gpu tests/test_staging.py tests/test_p2p.py \
    2>&1 | tee "$OUT/pytest.log" | grep -v PASSED
echo "== 2. the README's first command, unchanged (device auto: both ranks on the GPU)"
timeout 120 "${TORCHRUN[@]}" trainer/train.py 2>&1 | tee "$OUT/train.log" | tail -n 20
echo "== 3. timings: CUDA tensors over entrenar and gloo"
timeout 75 "${TORCHRUN[@]}" tests/gpu/bench_cuda.py --sizes 4K:16M:x4 --ddp-steps 10 \
    --json "$OUT/bench2.json" 2>&1 | tee "$OUT/bench.log" | tail -n 40
if [[ "${FULL:-0}" == 1 ]]; then
    echo "== 4. the whole suite on this machine's torch (FULL=1; tests/gpu/README.md lists what differed on 2.11)"
    timeout 290 "$PY" -m pytest -q -p no:cacheprovider -n 14 \
        --junitxml "$OUT/suite.xml" 2>&1 | tee "$OUT/suite.log" | tail -n 60
fi
