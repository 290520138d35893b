#!/usr/bin/env bash
# The GPU work of one session in two device calls (run from the repository root, `.whl` carried):
#
#   run(command="bash benchmarks/gpu_session.sh check", carry=[".whl"], kind="nvidia-h200-x2", timeout_s=600)
#   run(command="bash benchmarks/gpu_session.sh bench", carry=[".whl"], kind="nvidia-h200-x2", timeout_s=600)
#
# check: the GPU test suite (bigmem serially), the compute-sanitizer sweep, the 2-GPU training
#        parity run (context and tensor parallelism), the host-time profile with its floors.
# bench: every workload with every importable peer (python -m ropekit.bench), then the defaults'
#        same-size copy ceilings and graph replay (tune_core.py --defaults).
# explore / probe / round: issue 17's calls (the changed kernels' GPU tests with launch sweeps and
#        Nsight Compute profiles; the store's block order and PTX access widths; the measurement run
#        with every workload, peer and first-call time). Sweeps of rope_kernel's launch shapes:
#        tune_core.py --only W1,W2,W4,W5 --blocks 512,1024,2048 --warps 2,4 --head-loop=-1 --prefetch=0,1
# Each stage has its own time limit, so a slow stage cannot take the others' results with it.
# Everything lands in $OUT (at most 8 files come back): check.txt / pytest.txt / sanitizer.txt /
# parity.txt (+ distributed_parity.json); bench: results.json, RESULTS.md, log.txt, tune.txt.
set -uo pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site:src
fi
{
    echo "== $(date -u +%FT%TZ) $(git describe --always --dirty 2>/dev/null || echo no-git)"
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv 2>&1
    python3 -c 'import sys, torch, triton; print("python", sys.version.split()[0], "torch", torch.__version__,
"triton", triton.__version__, "gpus", torch.cuda.device_count())'
} > "$OUT/env.txt" 2>&1

stage() {   # stage NAME SECONDS CMD...: run with a limit, log to $OUT/NAME.txt, print its tail
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS
    timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1
    local rc=$?
    echo "$name rc=$rc in $((SECONDS - t0)) s" | tee -a "$OUT/$name.txt"
}

case "${1:-check}" in
check)
    stage pytest 300 python3 -m pytest -q -m "gpu and not bigmem" -n 12 -p no:cacheprovider tests
    stage bigmem 100 python3 -m pytest -q -m bigmem -p no:cacheprovider tests
    CUDA_VISIBLE_DEVICES=0 stage host 40 python3 benchmarks/profile_host.py
    stage parity 110 torchrun --standalone --nproc-per-node 2 benchmarks/distributed_parity.py
    stage parity_dtensor 110 torchrun --standalone --nproc-per-node 2 benchmarks/distributed_parity.py --modes tp \
        --tp-dtensor-activations
    CUDA_VISIBLE_DEVICES=0 stage sanitizer 150 compute-sanitizer --tool memcheck --error-exitcode 1 \
        python3 benchmarks/sanitizer_sweep.py --pool 16 -n 160
    for f in pytest bigmem host parity parity_dtensor sanitizer; do echo "== $f"; tail -6 "$OUT/$f.txt"; done
    ;;
recheck)    # after fixes: the parity runs (with two GPUs), the sanitizer sweep, and the given test files
    GPUS=$(python3 -c 'import torch; print(torch.cuda.device_count())')
    [ "$GPUS" -ge 2 ] && stage parity 110 torchrun --standalone --nproc-per-node 2 benchmarks/distributed_parity.py
    [ "$GPUS" -ge 2 ] && stage parity_dtensor 110 torchrun --standalone --nproc-per-node 2 \
        benchmarks/distributed_parity.py --modes tp --tp-dtensor-activations
    CUDA_VISIBLE_DEVICES=0 stage sanitizer 110 compute-sanitizer --tool memcheck --error-exitcode 1 \
        python3 benchmarks/sanitizer_sweep.py --pool 16 -n 120
    [ $# -gt 1 ] && stage pytest 150 python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider "${@:2}"
    CUDA_VISIBLE_DEVICES=0 stage bench 280 python3 -m ropekit.bench --no-progress --out "$OUT" \
        --results-md "$OUT/RESULTS.md" -w W3,W7-T64,W9,W10,W11,W12
    for f in parity parity_dtensor sanitizer pytest bench; do echo "== $f"; tail -8 "$OUT/$f.txt" 2>/dev/null; done
    ;;
bench)
    export CUDA_VISIBLE_DEVICES=0
    stage log 440 python3 -m ropekit.bench --no-progress --out "$OUT" --results-md "$OUT/RESULTS.md" "${@:2}"
    stage tune 120 python3 benchmarks/tune_core.py --defaults --blocks 2048 --warps 0 --out "$OUT"
    tail -60 "$OUT/log.txt"; tail -12 "$OUT/tune.txt"
    ;;
final)      # the whole GPU suite, the sanitizer sweep and the workloads changed last
    stage pytest 200 python3 -m pytest -q -m "gpu and not bigmem" -n 12 -p no:cacheprovider tests
    stage bigmem 100 python3 -m pytest -q -m bigmem -p no:cacheprovider tests
    CUDA_VISIBLE_DEVICES=0 stage sanitizer 120 compute-sanitizer --tool memcheck --error-exitcode 1 \
        python3 benchmarks/sanitizer_sweep.py --pool 16 -n 160
    CUDA_VISIBLE_DEVICES=0 stage bench 200 python3 -m ropekit.bench --no-progress --out "$OUT" \
        --results-md "$OUT/RESULTS.md" -w W3,W7-T64,W9,W10,W11,W12
    for f in pytest bigmem sanitizer bench; do echo "== $f"; tail -8 "$OUT/$f.txt" 2>/dev/null; done
    ;;
explore)    # issue 17: GPU tests of the changed kernels, launch sweeps, Nsight Compute profiles, inductor's W7 code
    export CUDA_VISIBLE_DEVICES=0
    stage pytest 120 python3 -m pytest -q -m gpu -n 12 -p no:cacheprovider tests/test_store.py \
        tests/test_apply_rope.py tests/test_qknorm.py tests/test_pipeline.py
    stage launch 180 python3 benchmarks/tune_launch.py --out "$OUT"
    stage ncu 150 bash benchmarks/ncu_profile.sh "W7 --knob store_head_loop=0" W7 W7-compile W6 W4 W3 W1
    TORCH_LOGS=output_code stage inductor 60 python3 benchmarks/profile_kernels.py W7-compile
    stage bench 70 python3 -m ropekit.bench --no-progress --no-plot --out /tmp/bench -w W3
    cp /tmp/bench/results.txt "$OUT/bench_results.txt" 2>/dev/null
    for f in pytest launch ncu inductor bench; do echo "== $f"; tail -4 "$OUT/$f.txt"; done
    grep -E "^W3|floor" "$OUT/bench_results.txt" | cut -c1-160
    ;;
probe)      # issue 17: the store's block order sweep, the PTX access widths of each workload's kernel, W7's profile
    export CUDA_VISIBLE_DEVICES=0
    stage pytest 90 python3 -m pytest -q -m gpu -n 12 -p no:cacheprovider tests/test_store.py tests/test_qknorm.py
    stage launch 120 python3 benchmarks/tune_launch.py --only store
    ptx() { for w in W7 W6 W4 W1 W2 W5 W3; do echo "=== $w"; python3 benchmarks/profile_kernels.py $w --ptx; done; }
    export -f ptx
    stage ptx 120 bash -c ptx
    stage ncu 60 bash benchmarks/ncu_profile.sh W7
    for f in pytest launch ptx; do echo "== $f"; tail -40 "$OUT/$f.txt"; done
    grep -E "Duration|DRAM Throughput|Registers Per|Achieved Occupancy" "$OUT/ncu.txt"
    ;;
round)      # issue 17's measurement run: whole GPU suite, every workload with peers, first calls
    stage pytest 150 python3 -m pytest -q -m "gpu and not bigmem" -n 12 -p no:cacheprovider tests
    stage bigmem 70 python3 -m pytest -q -m bigmem -p no:cacheprovider tests
    export CUDA_VISIBLE_DEVICES=0
    stage log 270 python3 -m ropekit.bench --no-progress --no-plot --out "$OUT" "${@:2}"
    stage limits 60 python3 benchmarks/limits.py
    for f in pytest bigmem limits; do echo "== $f"; tail -3 "$OUT/$f.txt"; done
    grep -E "^W[0-9]|floor" "$OUT/results.txt" | cut -c1-170
    ;;
last)       # after review mends: the whole GPU suite and every workload but W12 (timed in the runs before)
    stage pytest 150 python3 -m pytest -q -m "gpu and not bigmem" -n 12 -p no:cacheprovider tests
    stage bigmem 60 python3 -m pytest -q -m bigmem -p no:cacheprovider tests
    CUDA_VISIBLE_DEVICES=0 stage bench 200 python3 -m ropekit.bench --no-progress --no-plot --out "$OUT" \
        -w W1,W2,W3,W4,W5,W6,W7,W8,W9,W10,W11
    for f in pytest bigmem; do echo "== $f"; tail -3 "$OUT/$f.txt" 2>/dev/null; done
    grep -E "^W[0-9]|floors" "$OUT/results.txt" | cut -c1-140
    ;;
esac
