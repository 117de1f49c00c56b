#!/usr/bin/env bash
# A K-host cluster on one machine: network namespaces joined by veth links to a
# bridge, one torchrun per namespace, a multi-node training job over real TCP.
#
#   sudo launch/netns_cluster.sh                             # 2 hosts x 1 process
#   sudo NODES=2 NPROC=2 launch/netns_cluster.sh --steps 50  # flags go to train.py
#   sudo RATE=1gbit launch/netns_cluster.sh                  # every host link 1 Gbit/s each way
#   sudo NETEM="delay 1ms" launch/netns_cluster.sh           # where the kernel has sch_netem
#
# Topology (everything lives in namespaces this script creates; the root
# namespace's interfaces, routes and addresses are never touched):
#
#   <prefix>-sw : bridge br0, ports p0 .. p{K-1}
#   <prefix>-h0 : eth0 10.77.0.1/24  <-veth->  p0   (rendezvous host, node 0)
#   <prefix>-h1 : eth0 10.77.0.2/24  <-veth->  p1
#   ...
#
# Node i runs `torchrun --nnodes=K --rdzv-backend=c10d --rdzv-endpoint=10.77.0.1:PORT`
# inside <prefix>-h<i> with ENTRENAR_IFNAME=eth0, so the backend listens on the
# namespace's own address and ranks on different "hosts" talk over the veth
# links and the bridge. Node i's output goes to $LOG_DIR/node<i>.log; node 0's
# is also shown. On exit (success, failure or Ctrl-C) the trap stops the
# torchruns started here and deletes the namespaces (which removes their links).
#
# Environment:
#   NODES (2)             hosts (namespaces), at most 250
#   NPROC (1)             processes per host
#   PORT (29500)          rendezvous port on 10.77.0.1
#   NETNS_PREFIX (enr<pid>) namespace name prefix (unique per invocation)
#   LOG_DIR (runs/netns)  per-node logs
#   RATE                  optional rate (tc units: 1gbit, 100mbit) of every host
#                         link, both ways: a tbf qdisc on the host's eth0 (what it
#                         sends) and on its bridge port p<i> (what it receives), as
#                         a full-duplex NIC of that speed would; TBF_BURST (128kb)
#                         and TBF_LATENCY (20ms, the queue's bound) set the rest
#   NETEM                 optional tc-netem spec applied to every eth0 (e.g.
#                         "delay 1ms"; needs sch_netem, which not every kernel has);
#                         with RATE the tbf sits under it
#   PYTHON (python3)      the interpreter whose torchrun each node runs (as
#                         `$PYTHON -m torch.distributed.run`), so a venv's works
#                         without its bin/ on PATH (sudo drops PATH anyway)
#   TIMEOUT_S (0)         stop each node's torchrun after this many seconds (0: no limit)
#   NODE_CMD              run this bash command in every namespace instead of the
#                         torchrun above, with NODE (index), NODE_ADDR (its address)
#                         and HEAD_ADDR (node 0's) set and the script's arguments
#                         as $1..; e.g. a container command with the environment an
#                         operator would give each pod (tests/test_launch_k8s.py)
# Exit status: 0 when every node's torchrun succeeded; the first failing node's
# status otherwise; 77 when network namespaces cannot be created (not root).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/.." && pwd)"

nodes="${NODES:-2}"
nproc="${NPROC:-1}"
port="${PORT:-29500}"
prefix="${NETNS_PREFIX:-enr$$}"
log_dir="${LOG_DIR:-runs/netns}"
subnet="10.77.0"
timeout_s="${TIMEOUT_S:-0}"
python="${PYTHON:-python3}"
tbf_burst="${TBF_BURST:-128kb}"
tbf_latency="${TBF_LATENCY:-20ms}"

if ! [[ "$nodes" =~ ^[0-9]+$ ]] || ((nodes < 1 || nodes > 250)); then
    echo "netns_cluster: NODES must be 1..250, got '$nodes'" >&2
    exit 2
fi

sw="${prefix}-sw"
created=()
pids=()

cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    for pid in "${pids[@]}"; do
        kill "$pid" 2>/dev/null || true
    done
    for pid in "${pids[@]}"; do
        wait "$pid" 2>/dev/null || true
    done
    # Anything still running inside our namespaces was started by this script.
    for ns in "${created[@]}"; do
        for p in $(ip netns pids "$ns" 2>/dev/null); do
            kill -9 "$p" 2>/dev/null || true
        done
    done
    for ((idx = ${#created[@]} - 1; idx >= 0; idx--)); do
        ip netns del "${created[$idx]}" 2>/dev/null || true
    done
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

if ! ip netns add "$sw" 2>/dev/null; then
    echo "netns_cluster: cannot create network namespaces (needs root and ip netns)" >&2
    exit 77
fi
created+=("$sw")
ip -n "$sw" link set lo up
ip -n "$sw" link add br0 type bridge
ip -n "$sw" link set br0 up

for ((i = 0; i < nodes; i++)); do
    ns="${prefix}-h$i"
    ip netns add "$ns"
    created+=("$ns")
    ip -n "$ns" link set lo up
    ip -n "$ns" link add eth0 type veth peer name "p$i" netns "$sw"
    ip -n "$sw" link set "p$i" master br0
    ip -n "$sw" link set "p$i" up
    ip -n "$ns" addr add "$subnet.$((i + 1))/24" dev eth0
    ip -n "$ns" link set eth0 up
    if [[ -n "${NETEM:-}" ]]; then
        # shellcheck disable=SC2086
        ip netns exec "$ns" tc qdisc add dev eth0 root handle 1: netem $NETEM
    fi
    if [[ -n "${RATE:-}" ]]; then
        # burst above a 64 KiB GSO packet: tbf passes those whole instead of segmenting.
        tbf=(tbf rate "$RATE" burst "$tbf_burst" latency "$tbf_latency")
        if [[ -n "${NETEM:-}" ]]; then
            ip netns exec "$ns" tc qdisc add dev eth0 parent 1:1 handle 10: "${tbf[@]}"
        else
            ip netns exec "$ns" tc qdisc add dev eth0 root "${tbf[@]}"
        fi
        ip netns exec "$sw" tc qdisc add dev "p$i" root "${tbf[@]}"
    fi
done

# Wait until every link reports carrier (veth pairs come up within milliseconds).
for ((i = 0; i < nodes; i++)); do
    ok=0
    for _ in $(seq 50); do
        if ip -n "${prefix}-h$i" -o link show eth0 | grep -q 'LOWER_UP'; then
            ok=1
            break
        fi
        sleep 0.1
    done
    if ((ok == 0)); then
        echo "netns_cluster: eth0 in ${prefix}-h$i did not come up" >&2
        exit 3
    fi
done

mkdir -p "$log_dir"
if [[ -n "${NODE_CMD:-}" ]]; then
    echo "netns_cluster: $nodes hosts running NODE_CMD, head $subnet.1, logs in $log_dir" >&2
else
    echo "netns_cluster: $nodes hosts x $nproc processes, rendezvous $subnet.1:$port, logs in $log_dir" >&2
fi
for ((i = 0; i < nodes; i++)); do
    ns="${prefix}-h$i"
    addr="$subnet.$((i + 1))"
    is_host=0
    if ((i == 0)); then is_host=1; fi
    limit=()
    if ((timeout_s > 0)); then limit=(timeout -k 10 "$timeout_s"); fi
    if [[ -n "${NODE_CMD:-}" ]]; then
        ip netns exec "$ns" env NODE="$i" NODE_ADDR="$addr" HEAD_ADDR="$subnet.1" \
            "${limit[@]}" bash -c "$NODE_CMD" "node$i" "$@" >"$log_dir/node$i.log" 2>&1 &
        pids+=($!)
        continue
    fi
    ip netns exec "$ns" env \
        ENTRENAR_IFNAME=eth0 GLOO_SOCKET_IFNAME=eth0 \
        "${limit[@]}" "$python" -m torch.distributed.run \
        --nnodes="$nodes" \
        --node-rank="$i" \
        --nproc-per-node="$nproc" \
        --rdzv-backend=c10d \
        --rdzv-endpoint="$subnet.1:$port" \
        --rdzv-id="$prefix" \
        --rdzv-conf="is_host=$is_host" \
        --local-addr="$addr" \
        "$repo/trainer/train.py" "$@" >"$log_dir/node$i.log" 2>&1 &
    pids+=($!)
done

status=0
for ((i = 0; i < nodes; i++)); do
    rc=0
    wait "${pids[$i]}" || rc=$?
    if ((rc != 0)); then
        echo "netns_cluster: node $i exited with status $rc (log: $log_dir/node$i.log)" >&2
        tail -n 30 "$log_dir/node$i.log" >&2 || true
        if ((status == 0)); then status=$rc; fi
    fi
done
pids=()
grep -v '^W[0-9]' "$log_dir/node0.log" || true
exit "$status"
