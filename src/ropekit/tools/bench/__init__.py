"""Benchmark CLI for ropekit: ``python -m ropekit.bench`` (console script ``ropekit-bench``).

Modules: workloads (W1..W8 of WORKLOADS.md), peers (ropekit and the implementations it is
compared with), timing (CUDA events, graph replay, host time, copy bandwidth), runner (the run),
report (terminal table, JSON, PNG, RESULTS.md markdown). Nothing here is imported by ropekit.
"""
