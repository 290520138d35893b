#!/usr/bin/env bash
# The H200 benchmark run, for the device tool. Run from the repository root with `.whl` carried:
#
#   run(command="bash benchmarks/gpu_run.sh", carry=[".whl"], timeout_s=600)
#
# Installs the carried wheels (Liger-Kernel; torch, triton and transformers are on the machine),
# then runs every workload of shared/WORKLOADS.md with every importable implementation and writes
# under $OUT/bench (at most 8 files come back, at most 2 folders deep):
#   results.json  results.txt  results.png  RESULTS.md  log.txt
# Extra arguments go to `python -m ropekit.bench` (e.g. --workloads W1,W3 or --quick).
# results.json is rewritten after each workload, so a run stopped at the time limit still
# returns what it measured; regenerate the markdown from it with
#   python -m ropekit.bench.report results.json --results-md benchmarks/RESULTS.md --png results.png
set -uo pipefail

OUT=${OUT:-bench-out}
DEST="$OUT/bench"
mkdir -p "$DEST"
export PYTHONUNBUFFERED=1
export PYTHONPATH=src
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || { echo "wheel install failed" >&2; exit 1; }
    export PYTHONPATH=/tmp/site:src
fi

{
    echo "== $(date -u +%FT%TZ)  $(git describe --always --dirty 2>/dev/null || echo no-git)"
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv 2>&1 || true
    python3 -c 'import sys, torch, triton; print("python", sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__)'
} 2>&1 | tee "$DEST/log.txt"

python3 -m ropekit.bench --out "$DEST" --results-md "$DEST/RESULTS.md" "$@" 2>&1 | tee -a "$DEST/log.txt"
exit "${PIPESTATUS[0]}"
