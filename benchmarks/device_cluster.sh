#!/usr/bin/env bash
# The emulated-cluster goals where every rank has a core of its own: what a
# session lent the 16-core device machine runs there (as root), besides
# tests/gpu/device_check.sh. On the 2-core machine here eight ranks share two
# cores; the 4 x 2, 64 MiB goal (>= 1.15x gloo) is link-bound, and that sharing
# is the 1-2 % it misses by (docs/benchmarks.md).
#
# iproute2: where the machine has no `ip`, put its `ip` and `tc` with their
# libraries in .netns/ (bin/ wrappers, real/, lib/) and carry that folder.
# Everything lands in $OUT (default /tmp/entrenar-cluster); JOBS sets how many
# 64 MiB gloo + entrenar jobs run (default 3); SPIN=0 skips the idle-spin
# jobs, FULL=0 the every-size job.
set -uo pipefail
cd "$(dirname "$0")/.."
[[ -x .netns/bin/ip ]] && ! command -v ip >/dev/null && export PATH="$PWD/.netns/bin:$PATH"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 PYTHONPATH="$PWD" OUT="${OUT:-/tmp/entrenar-cluster}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"

echo "== 0. the machine: cores, kernel, iproute2, namespaces, tbf"
{
    echo "$(getconf _NPROCESSORS_ONLN) cores, kernel $(uname -r), $(command -v ip) $(ip -V 2>&1)"
    "$PY" -c "import torch; print('torch', torch.__version__)"
    "$PY" - <<'EOF'
from benchmarks.netns import namespaces_allowed, qdisc_available
print("namespaces:", namespaces_allowed())
print("tbf:", qdisc_available("tbf", "rate", "1gbit", "burst", "128kb", "latency", "20ms"))
EOF
} 2>&1 | tee "$OUT/machine.txt"
grep -q "namespaces: True" "$OUT/machine.txt" || { echo "no namespaces here: nothing to run"; exit 77; }

for ((j = 1; j <= ${JOBS:-3}; j++)); do
    echo "== 1.$j. 4 hosts x 2 ranks, 64 MiB, gloo and entrenar interleaved"
    timeout 90 "$PY" -m benchmarks.cluster --hosts 4 --local 2 --rate 1gbit --sizes 64M \
        --rounds 4 --variants gloo,entrenar --out "$OUT/j$j" 2>&1 | grep -A3 "^  size\|^ *64 MiB"
done
if [[ "${SPIN:-1}" == 1 ]]; then
    # The 4 x 2, 4 KiB lead (docs/benchmarks.md, "A core per rank"): its samples
    # fall in two modes a wake-up apart, and a leaf's wait through the star's root
    # outlasts the caller's 50 us spin. entrenar-idle-spin spins on for up to
    # 1 ms while no thread waits for a core (Options.idle_spin_us,
    # transport/spin.py): two jobs, each with gloo and entrenar interleaved.
    for k in 1 2; do
        echo "== 3.$k. 4 hosts x 2 ranks, small sizes, entrenar against entrenar-idle-spin"
        timeout 90 "$PY" -m benchmarks.cluster --hosts 4 --local 2 --rate 1gbit \
            --sizes 4K,16K,64K --rounds 8 --variants gloo,entrenar,entrenar-idle-spin \
            --out "$OUT/spin$k" 2>&1 | grep -E "^ *(4|16|64) KiB"
    done
fi
if [[ "${FULL:-1}" == 1 ]]; then
    echo "== 2. 4 hosts x 2 ranks, every size, the three variants"
    timeout 240 "$PY" -m benchmarks.cluster --hosts 4 --local 2 --rate 1gbit \
        --sizes 4K,64K,1M,16M,64M --rounds 4 --out "$OUT/full" 2>&1 | tail -n 25
fi
