#!/usr/bin/env bash
# The GPU host's check of one tree: its CUDA tests, then benchmarks/first_load.py and benchmarks/gpu_node.py (this
# script's copies, so a baseline tree without them is measured the same way), benchmarks/run.py --only gpu and
# benchmarks/verified.py (the tree's own).
#
#   bash scripts/device_check.sh [TREE [LABEL]]     TREE: a checkout (default: the repository this script sits in)
#
# Run it twice in one call to compare a baseline with the change; the checkpoints live outside the trees (under
# $DEVICE_CHECK_WORK, default /tmp/shardload-device-check) and are written once for both:
#
#   bash scripts/device_check.sh /tmp/base base; bash scripts/device_check.sh . change
#
# Wheels in this repository's .whl/ (or the tree's) are installed into /tmp/site without the network. Each step has
# a time limit; a failed step is reported and the others still run. Logs go to $OUT/device-check/LABEL/ when OUT is
# set (else /tmp/device-check/LABEL/). DEVICE_CHECK_GIB (default 1) sizes gpu_node's checkpoint, DEVICE_CHECK_RANKS
# (default 2) how many ranks its turn and warm modes measure at N = 8, DEVICE_CHECK_LOADERS its loaders (default all
# but instanttensor, the slowest), DEVICE_CHECK_BUDGET (default 330) the seconds
# the tree's steps may take in all (writing the checkpoints, once, is not counted). The summary comes last.
set -uo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
TREE=$(cd "${1:-$HERE}" && pwd) || { echo "device_check: no tree ${1:-}" >&2; exit 2; }
LABEL=${2:-$(basename "$TREE")}
PY=${PYTHON:-python3}
WORK=${DEVICE_CHECK_WORK:-/tmp/shardload-device-check}
GIB=${DEVICE_CHECK_GIB:-1}
RANKS=${DEVICE_CHECK_RANKS:-2}
BUDGET=${DEVICE_CHECK_BUDGET:-330}
# instanttensor took 3 to 6 s a rank on the H100 host (session 15): with it, gpu_node outgrows the budget
LOADERS=${DEVICE_CHECK_LOADERS:-default shardload presharded fastsafetensors safetensors}
LOGS=${OUT:-/tmp}/device-check/$LABEL
mkdir -p "$LOGS" "$WORK"
rm -f "$LOGS"/*.log "$LOGS/summary.txt" # a step skipped this time leaves no older log behind
SUMMARY=()
T0=$(date +%s)

# step NAME LIMIT_S COMMAND...: run it (in TREE) with its output in LOGS/NAME.log, for at most LIMIT_S seconds and
# what is left of the budget; record one summary line.
step() {
    local name=$1 limit=$2 start rc status left
    shift 2
    start=$(date +%s)
    left=$((BUDGET - (start - T0)))
    if [ "$left" -lt 15 ]; then
        skip "$name" "no time left of the ${BUDGET} s budget"
        return 1
    fi
    [ "$limit" -le "$left" ] || limit=$left
    (cd "$TREE" && timeout -k 10 "$limit" "$@") >"$LOGS/$name.log" 2>&1
    rc=$?
    case $rc in
        0) status=ok ;;
        124 | 137) status="TIMEOUT (${limit} s)" ;;
        *) status="FAILED (exit $rc)" ;;
    esac
    SUMMARY+=("$(printf '%-14s %-22s %4d s' "$name" "$status" $(($(date +%s) - start)))")
    [ "$rc" = 0 ] || SUMMARY+=("    $(grep -v '^\s*$' "$LOGS/$name.log" | tail -n 1 | cut -c1-200)")
    echo "[$LABEL] $name: $status" >&2
    return "$rc"
}

skip() { SUMMARY+=("$(printf '%-14s skipped: %s' "$1" "$2")"); echo "[$LABEL] $1: skipped ($2)" >&2; }

# (a) wheels carried in .whl/, installed once per machine
WHEELS=$(ls "$HERE"/.whl/*.whl 2>/dev/null || ls "$TREE"/.whl/*.whl 2>/dev/null || true)
if [ -n "$WHEELS" ]; then
    if [ "$(cat /tmp/site/.wheels 2>/dev/null)" = "$WHEELS" ]; then
        skip wheels "installed before in /tmp/site"
    else
        # shellcheck disable=SC2086
        step wheels 60 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site $WHEELS && echo "$WHEELS" >/tmp/site/.wheels
    fi
else
    skip wheels "no .whl/"
fi
export PYTHONPATH=/tmp/site:$TREE
export PYTHONDONTWRITEBYTECODE=1

# what this tree runs with: shardload from TREE, torch's CUDA, the peers
step env 60 "$PY" -c '
import importlib.util, sys, torch, shardload
print("shardload", shardload.__file__)
print("torch", torch.__version__, "cuda", torch.cuda.is_available(), torch.cuda.device_count())
if torch.cuda.is_available():
    print("gpu", torch.cuda.get_device_name(0))
for name in ("blake3", "jsonschema_rs", "re2", "jsonschema", "instanttensor", "fastsafetensors", "compressed_tensors"):
    print(name, "yes" if importlib.util.find_spec(name) else "MISSING")
sys.exit(0 if shardload.__file__.startswith(sys.argv[1]) else 3)' "$TREE"
CUDA=$("$PY" -c 'import torch; print(int(torch.cuda.is_available()))' 2>/dev/null || echo 0)

# The tree's modules compiled first, as an installed package's are: a fresh process's first load otherwise compiles
# each module it imports lazily from source (about 50 ms on an H200 host in session 27), which no server pays.
"$PY" -m compileall -q "$TREE/shardload" "$HERE/benchmarks" >/dev/null 2>&1 || true

# (b) the CUDA tests (each file to its end: one failure must not hide the rest)
PYTEST=("$PY" -m pytest -q -p no:cacheprovider)
if [ "$CUDA" = 1 ]; then
    step test_cuda 60 "${PYTEST[@]}" tests/test_cuda.py
    step cuda_cases 60 "${PYTEST[@]}" -k "cuda or gpu" tests/test_load.py tests/test_fill_api.py \
        tests/test_padding.py tests/test_quantize.py tests/test_api_args.py tests/test_shared_reads.py \
        $( [ -f tests/test_device_path.py ] && echo tests/test_device_path.py )
    step quant_formats 45 "${PYTEST[@]}" tests/test_quant_formats.py # every case also loads onto cuda:0
else
    for name in test_cuda cuda_cases quant_formats; do skip "$name" "no CUDA"; done
fi

# (c) the benchmarks: gpu_node.py from this script's tree, the checkpoints outside both trees (written once, the
# time not counted)
if [ "$CUDA" = 1 ]; then
    BUDGET=$((BUDGET + 600))
    start=$(date +%s)
    step checkpoints 300 "$PY" -c '
import subprocess, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1] + "/benchmarks")
from checkpoints import ensure_checkpoint
work, gib = Path(sys.argv[2]), float(sys.argv[3])
ensure_checkpoint(work / "run" / "model", 1.0, 8)  # run.py --keep WORK/run --size-gib 1 --num-shards 8
ensure_checkpoint(work / "verified" / "llama", 1.0, 8)  # verified.py --work WORK/verified --size-gib 1
subprocess.run([sys.executable, sys.argv[1] + "/benchmarks/gpu_node.py", "--prepare", "--size-gib", str(gib),
                "--tp", "2", "8", "--work", str(work / "gpu-node")], check=True)' "$HERE" "$WORK" "$GIB"
    BUDGET=$((BUDGET - 600 + $(date +%s) - start))
    # a fresh process's first load and the loads after it, per way (this script's copy, on gpu_node's checkpoint)
    step first_load 50 "$PY" "$HERE/benchmarks/first_load.py" --device cuda --size-gib "$GIB" --work "$WORK/gpu-node"
    # shellcheck disable=SC2086
    step gpu_node 240 "$PY" "$HERE/benchmarks/gpu_node.py" --device cuda --size-gib "$GIB" --tp 2 8 --ranks "$RANKS" \
        --work "$WORK/gpu-node" --repeats 1 --loaders $LOADERS
    if [ -f "$TREE/benchmarks/run.py" ]; then
        step run_gpu 45 "$PY" benchmarks/run.py --only gpu --num-shards 8 --size-gib 1 --repeats 2 --keep "$WORK/run"
    else
        skip run_gpu "no benchmarks/run.py in the tree"
    fi
else
    skip gpu_node "no CUDA (try: $PY benchmarks/gpu_node.py --device cpu --size-gib 0.25 --tp 2)"
    skip run_gpu "no CUDA"
fi
if [ -f "$TREE/benchmarks/verified.py" ]; then
    # 1 GiB, best of 3: at 0.25 GiB and one repeat a fresh process's fixed costs and noise were the verify figure
    # (session 16 found no serialisation of verifying jobs: they hash on up to 8 reader threads at once)
    step verified 60 "$PY" benchmarks/verified.py --work "$WORK/verified" --size-gib 1 --repeats 3
else
    skip verified "no benchmarks/verified.py in the tree"
fi

# the summary
{
    echo
    echo "== device check: $LABEL ($TREE), $(($(date +%s) - T0)) s, logs in $LOGS"
    printf '%s\n' "${SUMMARY[@]}"
    for name in test_cuda cuda_cases quant_formats; do
        [ -f "$LOGS/$name.log" ] && echo "$name: $(grep -E '(passed|failed|error|skipped|no tests ran)' "$LOGS/$name.log" | tail -n 1)"
    done
    [ -f "$LOGS/env.log" ] && grep -E 'MISSING|^gpu|^torch' "$LOGS/env.log"
    if [ -f "$LOGS/first_load.log" ]; then
        echo "-- first_load.py"
        grep -E '^(checkpoint|\||load average)' "$LOGS/first_load.log"
    fi
    if [ -f "$LOGS/gpu_node.log" ]; then
        echo "-- gpu_node.py"
        grep -E '^(checkpoint|cold|pinned|pageable|memcpy|loader|\||shardload on|  rank .*device path|MISMATCH|load average)' "$LOGS/gpu_node.log"
        grep -E 'Error|error:' "$LOGS/gpu_node.log" | grep -v '^|' | tail -n 3
    fi
    if [ -f "$LOGS/run_gpu.log" ]; then
        echo "-- run.py --only gpu"
        grep -E '^\| 5\.|5\. |targets missed|Error' "$LOGS/run_gpu.log" | tail -n 8
    fi
    if [ -f "$LOGS/verified.log" ]; then
        echo "-- verified.py"
        grep -E 'seconds|bytes|hash vs cat|Error' "$LOGS/verified.log" | tail -n 8
    fi
} | tee "$LOGS/summary.txt"
