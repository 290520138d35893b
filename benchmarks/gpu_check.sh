#!/usr/bin/env bash
# One device call: the tuning sweep, W8's host/GPU split, then the GPU test suite (bigmem included).
#
#   run(command="bash benchmarks/gpu_check.sh", timeout_s=600)
#
# Writes $OUT/tune.txt (+ tune_core.json), $OUT/w8.txt, $OUT/pytest.txt; each stage has its own
# time limit so a slow stage cannot take the others' results with it. Extra arguments go to
# tune_core.py (e.g. --blocks 2048 --warps 0 --prefetch 1 for the defaults only).
set -uo pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT/tune.txt" 2>&1
timeout 250 python3 benchmarks/tune_core.py --out "$OUT" "$@" >> "$OUT/tune.txt" 2>&1
echo "tune rc=$?" >> "$OUT/tune.txt"
timeout 90 python3 benchmarks/profile_w8.py --cprofile > "$OUT/w8.txt" 2>&1
echo "w8 rc=$?" >> "$OUT/w8.txt"
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_apply_rope.py tests/test_autograd.py \
    tests/test_64bit.py tests/test_modules.py tests/test_hf.py tests/test_store.py tests/test_compile.py \
    > "$OUT/pytest.txt" 2>&1
echo "pytest rc=$?" >> "$OUT/pytest.txt"
tail -3 "$OUT/pytest.txt"; tail -12 "$OUT/tune.txt"; cat "$OUT/w8.txt"
