#!/usr/bin/env bash
# Nsight Compute on one call of each named workload (benchmarks/profile_kernels.py), clocks as found.
#   bash benchmarks/ncu_profile.sh W7 "W7 --knob store_head_loop=0" W7-compile ...
SECTIONS=(--section SpeedOfLight --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables
    --section Occupancy --section LaunchStats --section WarpStateStats)
for w in "$@"; do
    echo "=== $w"
    # shellcheck disable=SC2086
    ncu --clock-control none --nvtx --nvtx-include "profiled/" "${SECTIONS[@]}" \
        python3 benchmarks/profile_kernels.py $w 2>&1 | grep -v "^==PROF=="
done
