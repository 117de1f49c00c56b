#!/usr/bin/env bash
# Multi-node training: one torchrun per host, joined by a c10d rendezvous.
#
# Run the same command on every host, changing only NODE_RANK (0 on the host
# named by RDZV_HOST, 1, 2, ... elsewhere):
#
#   # host A (10.0.0.1), also the rendezvous host:
#   RDZV_HOST=10.0.0.1 NNODES=2 NODE_RANK=0 NPROC=2 launch/multinode.sh --steps 400
#   # host B:
#   RDZV_HOST=10.0.0.1 NNODES=2 NODE_RANK=1 NPROC=2 launch/multinode.sh --steps 400
#
# Requirements: the repository (or the installed package) at the same path on
# every host, the same torch version, TCP reachability between all hosts on
# RDZV_PORT and on the ports the backend picks (entrenar listens on an
# ephemeral port per rank and publishes it through the rendezvous store), and,
# for --resume, a --checkpoint-dir on shared storage (NFS or similar): rank 0
# writes the checkpoint, every rank reads it.
#
# Environment:
#   RDZV_HOST, RDZV_PORT (29500)  where the c10d rendezvous store listens
#   NNODES (2), NODE_RANK (0), NPROC (processes per host: GPUs, or 1-2 on CPU)
#   RDZV_ID (entrenar-job)        unique per job, so two jobs never join
#   MAX_RESTARTS (0)              torchrun restarts of the whole group
#   ENTRENAR_IFNAME               NIC whose IPv4 address entrenar listens on
#   ENTRENAR_HOST                 or the address itself (wins over IFNAME)
#   RDZV_IS_HOST (auto)           1/0: whether this host runs the rendezvous
#                                 store; set it when the host's name does not
#                                 resolve to RDZV_HOST (containers, namespaces)
#   LOCAL_ADDR                    this host's address as the others reach it
#                                 (torchrun --local-addr; default: its FQDN)
#   PYTHON (python3)              the interpreter whose torchrun runs (as
#                                 `$PYTHON -m torch.distributed.run`), so a
#                                 venv's works without its bin/ on PATH
# Without ENTRENAR_HOST/IFNAME entrenar listens on the local address that routes
# to MASTER_ADDR, which is right on most clusters.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/.." && pwd)"

: "${RDZV_HOST:?set RDZV_HOST to the address of the rendezvous host (node 0)}"
rdzv_port="${RDZV_PORT:-29500}"
nnodes="${NNODES:-2}"
node_rank="${NODE_RANK:-0}"
nproc="${NPROC:-1}"

if [[ -n "${ENTRENAR_IFNAME:-}" ]]; then
    export ENTRENAR_IFNAME
    export GLOO_SOCKET_IFNAME="${GLOO_SOCKET_IFNAME:-$ENTRENAR_IFNAME}"  # for --backend gloo
fi
if [[ -n "${ENTRENAR_HOST:-}" ]]; then
    export ENTRENAR_HOST
fi

extra=()
if [[ -n "${RDZV_IS_HOST:-}" ]]; then
    extra+=(--rdzv-conf="is_host=${RDZV_IS_HOST}")
fi
if [[ -n "${LOCAL_ADDR:-}" ]]; then
    extra+=(--local-addr="$LOCAL_ADDR")
fi

exec "${PYTHON:-python3}" -m torch.distributed.run \
    --nnodes="$nnodes" \
    --node-rank="$node_rank" \
    --nproc-per-node="$nproc" \
    --rdzv-backend=c10d \
    --rdzv-endpoint="$RDZV_HOST:$rdzv_port" \
    --rdzv-id="${RDZV_ID:-entrenar-job}" \
    "${extra[@]}" \
    --max-restarts="${MAX_RESTARTS:-0}" \
    "$repo/trainer/train.py" "$@"
