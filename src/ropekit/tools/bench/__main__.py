"""python -m ropekit.bench (console script: ropekit-bench)

Runs the workloads of WORKLOADS.md with ropekit and its peers, measuring in the same run the
device-to-device copy bandwidth; for each implementation: a float64 correctness check first,
then median time, GB/s and percent of copy bandwidth. Writes a terminal table, a JSON file, a
PNG bar chart and (with --results-md) the markdown of benchmarks/RESULTS.md.

Without a GPU it runs at the quick sizes on the CPU and says that these are CPU numbers; its cells
are then times and their ratio to Hugging Face's code in torch eager (a CPU has no copy bandwidth
worth comparing against).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

from . import peers as P
from . import report, runner
from . import workloads as W


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m ropekit.bench",
        description="RoPE benchmarks: ropekit against torch eager (HF code), torch.compile, "
        "Liger-Kernel, FlashInfer, vLLM and flash-attn, as percent of copy bandwidth (on a CPU: times and "
        "ratios to HF's code).",
    )
    ap.add_argument(
        "--workloads",
        "-w",
        default="all",
        help="comma list of workload ids or names (W1,W3,...; W7 selects W7 and W7-T64, W3 selects W3 and "
        "W3-1); default: all",
    )
    ap.add_argument(
        "--peers",
        "-p",
        default=None,
        help=f"comma list of implementations ({', '.join(P.NAMES)}); default: all that "
        "are importable (CPU run: ropekit, reference, torch-eager)",
    )
    ap.add_argument("--quick", action="store_true", help="small sizes (a smoke run); always on without a GPU")
    ap.add_argument("--device", default="auto", help="auto (default), cuda, or cpu")
    ap.add_argument(
        "--out", default="bench-out", help="folder for results.json, results.png, results.txt (default: bench-out)"
    )
    ap.add_argument(
        "--results-md",
        metavar="PATH",
        default=None,
        help="also write the RESULTS.md markdown (table, plot reference, command, versions)",
    )
    ap.add_argument("--no-plot", action="store_true", help="skip the PNG")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    ap.add_argument("--warmup-ms", type=float, default=25.0, help="do_bench warm-up (ms)")
    ap.add_argument("--rep-ms", type=float, default=100.0, help="do_bench repetition time (ms)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--list", action="store_true", help="list workloads and implementations, then exit")
    return ap


def _list() -> str:
    lines = ["workloads:"]
    for w in W.WORKLOADS:
        lines.append(f"  {w.id:7s} {w.name:17s} {w.what}")
        lines.append(f"  {'':7s} {'':17s} full {w.full}  quick {w.quick}")
    lines.append("implementations:")
    for p in P.all_peers():
        lines.append(f"  {p.name:14s} {p.label}")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.list:
        print(_list())
        return 0
    try:
        wls = W.select(args.workloads)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    peers = [s.strip() for s in args.peers.split(",") if s.strip()] if args.peers else None
    shown = sys.argv[1:] if argv is None else list(argv)
    cfg = runner.Config(
        workloads=wls,
        peers=peers,
        quick=args.quick,
        device=args.device,
        warmup_ms=args.warmup_ms,
        rep_ms=args.rep_ms,
        seed=args.seed,
        progress=not args.no_progress,
        command="python -m ropekit.bench " + " ".join(shlex.quote(a) for a in shown),
    )
    os.makedirs(args.out, exist_ok=True)
    json_path = os.path.join(args.out, "results.json")
    cfg.checkpoint = lambda partial: report.write_json(partial, json_path)  # survives a kill
    res = runner.run(cfg)

    png_path = os.path.join(args.out, "results.png")
    txt_path = os.path.join(args.out, "results.txt")
    table = report.terminal(res)
    print(table)
    with open(txt_path, "w") as f:
        f.write(table + "\n")
    report.write_json(res, json_path)
    written = [json_path, txt_path]
    png = None
    if not args.no_plot:
        ok, msg = report.write_png(res, png_path)
        if ok:
            png = png_path
            written.append(png_path)
        else:
            print(msg)
    if args.results_md:
        report.write_markdown(res, args.results_md, png)
        written.append(args.results_md)
    print("wrote " + ", ".join(written))
    if res["meta"]["cpu_mode"]:
        print("(CPU numbers, not GPU numbers)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
