#!/usr/bin/env bash
# Single-node training: torchrun --standalone with NPROC processes.
#
#   launch/local.sh                 # 2 processes (or $NPROC), backend entrenar
#   launch/local.sh 4 --steps 100   # 4 processes, extra flags go to trainer/train.py
#   NPROC=4 launch/local.sh --backend gloo
#   MAX_RESTARTS=3 launch/local.sh 2 --resume   # restart the group on a failure
#   PYTHON=venv/bin/python launch/local.sh      # torchrun of that interpreter
#
# One process per GPU when CUDA is available (the trainer picks cuda:LOCAL_RANK),
# otherwise CPU processes sharing the cores (the trainer gives each
# cores/NPROC intra-op threads).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/.." && pwd)"

nproc="${NPROC:-2}"
if [[ $# -gt 0 && "$1" =~ ^[0-9]+$ ]]; then
    nproc="$1"
    shift
fi

# torchrun as a module of $PYTHON (python3): the launcher of the interpreter
# that has torch and this package, even when that venv's bin/ is not on PATH.
exec "${PYTHON:-python3}" -m torch.distributed.run \
    --standalone \
    --nnodes=1 \
    --nproc-per-node="$nproc" \
    --max-restarts="${MAX_RESTARTS:-0}" \
    "$repo/trainer/train.py" "$@"
