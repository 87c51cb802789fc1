#!/usr/bin/env bash
# The GPU machine's check (issue 40), from the wheel in dist/: see benches/device/README.md.
#
#   bash benches/device/run.sh OUTDIR
#
# Installs dist/hetcoll-*.whl into a target folder (no index, no dependencies: the machine has
# torch, numpy, lightning, mpi4py and pytest), then runs each step under its own `timeout`:
#   env        python, torch, the GPU (nvidia-smi)
#   kernels    weighted_sum on CUDA tensors against torch's add_ chain, _foreach and a copy
#   pytest     pytest -m cuda tests/test_cuda.py (junit XML)
#   calibrate  hetcoll model calibrate (the CPU ranks' device and the gloo link)
#   hetero     1 GPU rank + 3 and 7 CPU ranks: speeds, balanced vs equal vs the GPU alone,
#              the model's predictions, the balanced step's parts, a GPU-CPU message's hop
#   plans      1 GPU rank + 3 CPU ranks: 10-11 plans of the demo CNN under parallelize
#              (data-parallel, filter split, pipelines, hybrid), each measured and predicted
#   lm         1 GPU rank + 3 CPU ranks: examples/train_lm.py's Llama, balanced vs equal vs the
#              GPU alone (tokens/s), a pipeline and a hybrid, each measured and predicted
# and writes OUTDIR/summary.json (every step's status, seconds and results) and OUTDIR/log.txt.
# The step limits add up to 470 s, so a run ends within 8 minutes whatever hangs. Without CUDA
# it is the dry run: every CUDA figure is "skipped: no CUDA", with small step counts.
set -u
OUT=${1:?usage: bash benches/device/run.sh OUTDIR}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PY=${PYTHON:-python3}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
LOG=$OUT/log.txt
STEPS=$OUT/steps.jsonl
: >"$LOG"
: >"$STEPS"
cd "$ROOT"

# step NAME TIMEOUT_S COMMAND...: run it with its limit, log its output, record its outcome.
step() {
    local name=$1 limit=$2
    shift 2
    echo "=== $name (limit ${limit}s): $*" | tee -a "$LOG"
    local t0=$SECONDS
    timeout --kill-after=10 "$limit" "$@" >>"$LOG" 2>&1
    local rc=$?
    local took=$((SECONDS - t0))
    echo "=== $name: rc=$rc after ${took}s" | tee -a "$LOG"
    printf '{"step": "%s", "rc": %d, "seconds": %d, "limit_s": %d}\n' \
        "$name" "$rc" "$took" "$limit" >>"$STEPS"
    return 0
}

WHEEL=$(ls dist/hetcoll-*-abi3-*.whl 2>/dev/null | head -n 1)
if [ -n "${HETCOLL_DEVICE_SITE:-}" ]; then
    # A folder that holds a hetcoll already (the checkout's python/, for a dry run without a
    # wheel): used as it is. Nothing is installed into it, nor removed from it.
    SITE=$HETCOLL_DEVICE_SITE
    echo "HETCOLL_DEVICE_SITE: the hetcoll in $SITE, no wheel installed" | tee -a "$LOG"
    printf '{"step": "install", "rc": 2, "seconds": 0, "limit_s": 0}\n' >>"$STEPS"
elif [ -z "$WHEEL" ]; then
    echo "no dist/hetcoll-*-abi3-*.whl: run make wheel first (and carry dist)" | tee -a "$LOG"
    printf '{"step": "install", "rc": 2, "seconds": 0, "limit_s": 0}\n' >>"$STEPS"
    exit 2
else
    # A folder of the script's own, emptied each run.
    SITE=$(mktemp -d "${TMPDIR:-/tmp}/hetcoll-device-site.XXXXXX")
    trap 'rm -rf "$SITE"' EXIT
    step install 30 "$PY" -m pip install --no-index --no-deps --target "$SITE" "$WHEEL"
fi
# The wheel's hetcoll, never the checkout's python/ folder; tests/ for the cases modules.
export PYTHONPATH=$SITE
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export PYTHONUNBUFFERED=1

# Each job's own limit (--timeout) is under its step's, so a hung job still leaves its
# script the seconds to write what it measured.
HETERO=(--steps 12 --probe-s 2 --timeout 25)
PLANS=(--timeout 55)
LM=(--timeout 50)
# calibrate measures the CPU device on this many ranks side by side, as the jobs run: plans,
# lm and hetero's first configuration run 4 processes (3 CPU ranks and the GPU's).
CPU_RANKS=4
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>>"$LOG"; then
    echo "no CUDA: the dry run (small step counts)" | tee -a "$LOG"
    HETERO=(--cpu-ranks 1 --batch 64 --warmup 1 --steps 3 --probe-s 1 --timeout 40)
    PLANS=(--cpu-ranks 2 --batch 32 --warmup 1 --steps 3 --probe-s 1 --timeout 55)
    LM=(--cpu-ranks 2 --batch 8 --warmup 1 --steps 2 --probe-s 1 --timeout 50)
    CPU_RANKS=2
fi

step env 15 "$PY" benches/device/environment.py --json "$OUT/environment.json"
step kernels 30 "$PY" benches/device/kernels.py --json "$OUT/kernels.json"
# Each test limited too (pytest-timeout): a hung one fails with its ranks' stacks in the log
# (launch.spawn prints them as it kills them) and the tests after it still run.
step pytest 170 "$PY" -m pytest -m cuda -v -p no:cacheprovider -o addopts="" --timeout 55 \
    --junitxml "$OUT/pytest-cuda.xml" tests/test_cuda.py
step calibrate 45 "$PY" -m hetcoll.cli model calibrate --links gloo --ranks "$CPU_RANKS" \
    --output "$OUT/cluster.toml"
step hetero 55 "$PY" benches/device/hetero.py --cluster "$OUT/cluster.toml" \
    --json "$OUT/hetero.json" "${HETERO[@]}"
step plans 65 "$PY" benches/device/plans.py --cluster "$OUT/cluster.toml" \
    --json "$OUT/plans.json" "${PLANS[@]}"
step lm 60 "$PY" benches/device/lm.py --cluster "$OUT/cluster.toml" \
    --json "$OUT/lm.json" "${LM[@]}"

"$PY" benches/device/summarize.py "$OUT" 2>>"$LOG" | tee -a "$LOG"
# The device tool brings back 8 files at most: the steps' own files go into one archive
# (summary.json holds what they say; log.txt, everything printed).
STEP_FILES=(environment.json kernels.json pytest-cuda.xml cluster.toml hetero.json plans.json
    lm.json steps.jsonl)
(cd "$OUT" && tar czf steps.tar.gz --ignore-failed-read "${STEP_FILES[@]}" 2>/dev/null &&
    rm -f "${STEP_FILES[@]}")
