"""Formats a results dict (runner.run) as a terminal table, JSON, a PNG bar chart and the
markdown of benchmarks/RESULTS.md.

Regenerate the markdown from a saved run:
    python -m ropekit.bench.report RESULTS.json --results-md benchmarks/RESULTS.md [--png PLOT.png]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
from typing import Dict, List, Optional, Tuple

STATUS_CELL = {"n/a": "n/a", "skipped": "skipped", "error": "error"}


def _us(x: Optional[float]) -> str:
    if x is None:
        return "–"
    if x < 10:
        return f"{x:.2f} us"
    if x < 100:
        return f"{x:.1f} us"
    return f"{x:.0f} us"


NOISY = "!"  # marks a figure whose max / min is above timing.SPREAD_FLAG


def _spread(sp: Optional[dict]) -> str:
    """' [min-max]' in microseconds, with NOISY appended when the spread is above the flag."""
    if not sp:
        return ""
    return f" [{_num(sp['min'])}-{_num(sp['max'])}]" + (NOISY if sp.get("noisy") else "")


def _num(x: float) -> str:
    return f"{x:.2f}" if x < 10 else (f"{x:.1f}" if x < 100 else f"{x:.0f}")


def _ratios(value_us: Optional[float], floors: Optional[dict], names: Tuple[str, ...]) -> str:
    """' (2.1x launch, 3.0x aten)': value over each floor's median."""
    if value_us is None or not floors:
        return ""
    parts = [f"{value_us / floors[n]['median']:.1f}x {n}" for n in names if floors.get(n) and floors[n]["median"] > 0]
    return f" ({', '.join(parts)})" if parts else ""


def _cell(rec: dict, graph: bool, floors: Optional[dict] = None) -> str:
    """floors: host floors for a fwd+bwd row (ratio to 'autograd'), or {'in-graph launch': stats} for a
    one-set graph row (ratio to the empty kernel launched inside a graph)."""
    if rec["status"] != "ok":
        return _status_cell(rec)
    spread = _spread(rec.get("time_spread"))
    extra = _ratios(rec["time_us"], floors, ("autograd", "in-graph launch")) if floors else ""
    if graph:
        return _us(rec["time_us"]) + spread + extra
    return f"{rec['pct_copy']:.1f}% ({_us(rec['time_us'])}{spread}){extra}"


HF_PEER = "torch-eager"  # the CPU table's yardstick: Hugging Face's code (or plain torch) in eager mode
CPU_CELLS = (
    "cells: median time per call [fastest-slowest] (time / the torch eager (HF code) column's time: "
    "below 1.00x is faster than HF)"
)


def _cpu_cell(rec: dict, hf_us: Optional[float]) -> str:
    """CPU run: '812 us [790-905] (0.62x HF)': the time and its ratio to the HF-code column."""
    if rec["status"] != "ok":
        return _status_cell(rec)
    cell = _us(rec["time_us"]) + _spread(rec.get("time_spread"))
    if hf_us:
        ratio = f"{rec['time_us'] / hf_us:.2f}x HF"
        rounds = rec.get("ratio_rounds")
        if rec.get("ratio_noisy") and rounds:  # the ratio moved between the rounds: not a figure to quote
            ratio += f", {min(rounds):.2f}-{max(rounds):.2f}x over {len(rounds)} rounds{NOISY}"
        cell += f" ({ratio})"
    return cell


def _hf_times(res: dict) -> Dict[str, float]:
    """Workload id -> the HF-code column's median time, where it ran and passed the check."""
    return {
        r["workload"]: r["time_us"]
        for r in res["results"]
        if r["peer"] == HF_PEER and r["status"] == "ok" and r["time_us"]
    }


def _status_cell(rec: dict) -> str:
    """A cell that was not timed: wrong (with its error), n/a, skipped or error."""
    st = rec["status"]
    if st == "wrong":
        errs = {k: (math.inf if isinstance(v, str) else v) for k, v in (rec.get("rel_err") or {}).items()}
        tols = rec.get("tolerance") or {}
        worst = max(errs, key=lambda k: errs[k] / tols.get(k, 1.0)) if errs else None
        if worst is None or math.isinf(errs[worst]):
            return f"WRONG ({worst or 'output'}: nan)"
        tol = f" > {tols[worst]:g}" if worst in tols else ""
        return f"WRONG ({worst}: err {errs[worst]:.1e}{tol})"
    return STATUS_CELL.get(st, st)


def _columns(res: dict) -> List[dict]:
    """Peers that ran at least one workload, in peer order."""
    ran = {r["peer"] for r in res["results"]}
    return [p for p in res["peers"] if p["name"] in ran]


def pivot(res: dict) -> Tuple[List[str], List[List[str]]]:
    """Rows: workloads (+ a 'host per call' row where measured); columns: implementations."""
    cols = _columns(res)
    by = {(r["workload"], r["peer"]): r for r in res["results"]}
    cpu = res["meta"]["cpu_mode"]
    hf = _hf_times(res) if cpu else {}
    same = not cpu and any(w.get("same_size_copy_gbps") for w in res["workloads"])
    header = ["workload"] + [c["label"] for c in cols] + ([SAME_HEADER] if same else [])
    rows = []
    for w in res["workloads"]:
        graph = w["graph"] and not cpu
        floors = w.get("host_floors")
        # W8: its time over the Function floor (not W8-G: a graph replay runs no autograd bookkeeping)
        fwdbwd = floors if (floors and not w["host"] and not graph) else None
        gfloor = w.get("graph_launch_floor")
        if graph and gfloor and gfloor.get("median"):  # one-set graph row: its time over the in-graph launch
            fwdbwd = {"in-graph launch": gfloor}
        label = f"{w['id']} {w['name']}" + (" (graph)" if graph else "")
        cell = (lambda rec: _cpu_cell(rec, hf.get(w["id"]))) if cpu else (lambda rec: _cell(rec, graph, fwdbwd))
        rows.append(
            [label]
            + [cell(by[(w["id"], c["name"])]) if (w["id"], c["name"]) in by else "–" for c in cols]
            + ([_same_cell(w, by.get((w["id"], "ropekit")))] if same else [])
        )
        if w["host"] and any(by.get((w["id"], c["name"]), {}).get("host_us") is not None for c in cols):
            rows.append(
                [f"{w['id']} host per call"]
                + [_host_cell(by[(w["id"], c["name"])], floors) if (w["id"], c["name"]) in by else "–" for c in cols]
                + (["–"] if same else [])
            )
    return header, rows


SAME_HEADER = "same-size copy: % of copy; ropekit's % of it"


def _same_cell(w: dict, rk: Optional[dict]) -> str:
    """'92.2%; ropekit 96.4%': the same-size copy against the big copy, ropekit against it."""
    if not w.get("same_size_copy_gbps"):
        return "–"
    cell = f"{w['same_size_copy_pct']:.1f}%"
    if rk and rk.get("pct_same_size_copy"):
        cell += f"; ropekit {rk['pct_same_size_copy']:.1f}%"
    return cell


def _host_cell(rec: dict, floors: Optional[dict]) -> str:
    h = rec.get("host_us")
    if h is None:
        return "–"
    return _us(h) + _spread(rec.get("host_spread")) + _ratios(h, floors, ("direct", "launch", "aten"))


def floor_lines(res: dict) -> List[str]:
    """One line per workload with host floors: each floor's median and spread, in microseconds."""
    out = []
    names = {
        "direct": "direct launch of ropekit's compiled kernel, arguments prebuilt",
        "launch": "empty Triton kernel launch, kernel[(1,)](q)",
        "aten": "in-place ATen op, q.add_(0)",
        "autograd": "empty autograd.Function, forward + backward",
    }
    for w in res["workloads"]:
        f = w.get("host_floors")
        if not f:
            continue
        parts = []
        for key, what in names.items():
            if f.get(key):
                parts.append(f"{what}: {_us(f[key]['median'])}{_spread(f[key])}")
            elif key in f.get("why", {}):
                parts.append(f"{what}: not measured ({f['why'][key]})")
        flag = " [TRITON INTERPRETER launch, CPU: not a GPU floor]" if f.get("interpreted") else ""
        out.append(f"{w['id']} host floors{flag}: " + "; ".join(parts))
    return out


def graph_floor_lines(res: dict) -> List[str]:
    """One line per one-set graph row: the in-graph launch floor measured in the same run."""
    out = []
    for w in res["workloads"]:
        f = w.get("graph_launch_floor")
        if not f:
            continue
        if f.get("median") is None:
            out.append(f"{w['id']} graph floor: not measured ({f.get('why', '')})")
        else:
            out.append(f"{w['id']} graph floor: {f['what']}: {_us(f['median'])}{_spread(f)}")
    return out


def same_size_lines(res: dict) -> List[str]:
    """What the same-size copy column is, once (GPU runs: a CPU table has no such column)."""
    if res["meta"]["cpu_mode"] or not any(w.get("same_size_copy_gbps") for w in res["workloads"]):
        return []
    return [
        "same-size copy: torch's contiguous copy_ moving each workload's minimal bytes (half read, half "
        "written), timed like the row in the same run; rows timed under graph replay have none"
    ]


def cpu_speed_lines(res: dict) -> List[str]:
    """The CPU-tensor row: ropekit's CPU path against HF's apply_rotary_pos_emb, same process."""
    cs = res["meta"].get("cpu_speed")
    if not cs:
        return []
    if "skipped" in cs:
        return [f"CPU tensors, ropekit vs HF eager: skipped ({cs['skipped']})"]
    sz = cs.get("sizes", {})
    head = (
        "CPU tensors (no interpreter), B={B} S={S} Hq={Hq} Hk={Hk} D={D}, median of single calls "
        "[min-max], ratio to HF's apply_rotary_pos_emb:"
    ).format(**sz)
    out = [head]
    for dt, row in cs.items():
        if dt == "sizes":
            continue
        hf = row["hf"]["median"]
        cells = [f"{name} {_us(st['median'])}{_spread(st)} ({st['median'] / hf:.2f}x)" for name, st in row.items()]
        out.append(f"  {dt}: " + "; ".join(cells))
    return out


def _text_table(header: List[str], rows: List[List[str]]) -> str:
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
    line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(header), sep] + [line(r) for r in rows])


def _md_table(header: List[str], rows: List[List[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def notes(res: dict) -> List[str]:
    """Why peers were skipped, what n/a / wrong / error means per cell, which function ran."""
    out = []
    for p in res["peers"]:
        if not p["available"]:
            out.append(f"{p['label']}: skipped, {p['reason'] or 'not available'}")
    grouped: Dict[Tuple[str, str, str], List[str]] = {}
    for r in res["results"]:
        if r["status"] != "ok":
            grouped.setdefault((r["peer"], r["status"], r["reason"]), []).append(r["workload"])
    label = {p["name"]: p["label"] for p in res["peers"]}
    for (peer, st, why), wls in grouped.items():
        out.append(f"{label.get(peer, peer)} {', '.join(wls)}: {st}: {why}")
    seen: Dict[Tuple[str, str], List[str]] = {}
    for r in res["results"]:
        if r.get("note") and r["status"] in ("ok", "wrong"):
            seen.setdefault((r["peer"], r["note"]), []).append(r["workload"])
    for (peer, note), wls in seen.items():
        out.append(f"{label.get(peer, peer)} {', '.join(wls)}: {note}")
    for d in res["meta"].get("oracle_disagreements") or []:
        out.append("WARNING oracle disagreement: " + d)
    return out


def _heading(res: dict) -> List[str]:
    m, c = res["meta"], res["copy"]
    lines = []
    if m.get("partial"):
        lines.append("*** PARTIAL RUN: the run stopped before every workload was measured ***")
    if m["cpu_mode"]:
        lines.append("*** " + CPU_BANNER + " ***")
        lines.append(f"device: {m['device']}   [CPU]")
    else:
        lines.append(f"device: {m['device']}   copy bandwidth: {c['gbps']:.0f} GB/s ({c['what']})")
    lines.append(
        f"sizes: {'quick' if m['quick'] else 'full (WORKLOADS.md)'}   dtype: {m['dtype']}   "
        f"oracle: {m.get('oracle') or '-'}"
    )
    if m["cpu_mode"] and m.get("triton_interpret"):
        lines.append("TRITON_INTERPRET=1: ropekit ran its Triton kernels in the interpreter (slow by design)")
    return lines


CPU_BANNER = (
    "CPU RUN: no CUDA device was used. These are CPU numbers (pure-PyTorch paths at quick sizes), "
    "not GPU numbers: times, and ratios to Hugging Face's code in torch eager"
)


def terminal(res: dict) -> str:
    header, rows = pivot(res)
    parts = _heading(res)
    if res["meta"]["cpu_mode"]:
        parts.append(CPU_CELLS)
    else:
        parts.append(
            "cells: % of copy bandwidth (median time per call); (graph) rows: time per call under CUDA-graph replay"
        )
    parts += ["", _text_table(header, rows), ""]
    parts += same_size_lines(res) + graph_floor_lines(res) + floor_lines(res) + cpu_speed_lines(res)
    parts += [f"[min-max]: fastest and slowest call; '{NOISY}': max / min above the noise flag", ""]
    if res["meta"]["cpu_mode"]:
        parts[-1:] = [
            f"CPU cells: every cell timed in rounds, the peers in turn; 'a-bx over n rounds{NOISY}': the ratio to HF "
            "moved between the rounds by more than the noise flag (a loaded host: rerun before quoting it)",
            "",
        ]
    parts += ["notes:"] + ["  - " + n for n in notes(res)]
    if res["meta"]["cpu_mode"]:
        parts += ["", "*** CPU numbers, not GPU numbers ***"]
    return "\n".join(parts)


def _worst_err(rec: dict) -> str:
    errs = list((rec.get("rel_err") or {}).values())
    if not errs:
        return "–"
    w = max((math.inf if isinstance(v, str) else v) for v in errs)
    return "nan" if math.isinf(w) else f"{w:.1e}"


def _maybe(x: Optional[float], fmt: str) -> str:
    return "–" if x is None else fmt.format(x)


def details_rows(res: dict) -> Tuple[List[str], List[List[str]]]:
    """One row per (workload, implementation). GPU runs: bandwidth columns; CPU runs: the ratio
    to the HF-code column instead."""
    cpu = res["meta"]["cpu_mode"]
    hf = _hf_times(res) if cpu else {}
    middle = ["time / HF"] if cpu else ["GB/s", "% copy", "% same-size copy"]
    header = ["workload", "implementation", "status", "time"] + middle + ["host/call", "max rel err", "timing"]
    label = {p["name"]: p["label"] for p in res["peers"]}
    rows = []
    for r in res["results"]:
        if cpu:
            hf_us = hf.get(r["workload"])
            middle = [_maybe(r["time_us"] / hf_us if (hf_us and r["time_us"]) else None, "{:.2f}x")]
        else:
            middle = [
                _maybe(r["gbps"], "{:.0f}"),
                _maybe(r["pct_copy"], "{:.1f}%"),
                _maybe(r.get("pct_same_size_copy"), "{:.1f}%"),
            ]
        rows.append(
            [r["workload"], label.get(r["peer"], r["peer"]), r["status"], _us(r["time_us"])]
            + middle
            + [_us(r["host_us"]), _worst_err(r), r["method"] or r["reason"]]
        )
    return header, rows


def write_json(res: dict, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(res, f, indent=1, default=str)


PANEL_WORKLOADS = 8  # workloads per panel: at most 8 groups of bars in a row stay readable
PLOT_SIZE = dict(width_in=12.0, panel_in=3.0, dpi=110)  # about 1320 px wide, 330 px a panel


def _bar_value(rec: Optional[dict], hf_us: Optional[float], cpu: bool) -> Optional[float]:
    """The plotted value of a cell: % of copy (GPU), HF's time over this time (CPU); None if not timed."""
    if not rec or rec["status"] != "ok":
        return None
    if cpu:
        return hf_us / rec["time_us"] if (hf_us and rec["time_us"]) else None
    return rec["pct_copy"]


def _draw_panel(ax, wls: List[dict], cols: List[dict], by: dict, hf: Dict[str, float], cpu: bool) -> None:
    """One row of the chart: grouped bars for `wls`, one bar per implementation, values on top."""
    width = 0.8 / max(1, len(cols))
    for j, c in enumerate(cols):
        for i, w in enumerate(wls):
            rec = by.get((w["id"], c["name"]))
            x = i - 0.4 + width * (j + 0.5)
            y = _bar_value(rec, hf.get(w["id"]), cpu)
            if y is None:
                if rec and rec["status"] in ("wrong", "error"):
                    ax.text(
                        x,
                        0.02,
                        rec["status"],
                        rotation=90,
                        ha="center",
                        va="bottom",
                        fontsize=7,
                        color="red",
                        transform=ax.get_xaxis_transform(),
                    )
                continue
            ax.bar(x, y, width, color=f"C{j}")
            ax.text(x, y, f"{y:.2g}x" if cpu else f"{y:.0f}", ha="center", va="bottom", fontsize=7)
    if cpu:
        ax.set_yscale("log")
    ax.axhline(1.0 if cpu else 100.0, color="gray", linestyle="--", linewidth=0.8)
    ax.set_xticks(range(len(wls)))
    star = lambda w: "*" if w["graph"] and not cpu else ""  # noqa: E731
    ax.set_xticklabels([f"{w['id']}{star(w)}\n{w['name']}" for w in wls], fontsize=8)
    ax.set_xlim(-0.6, max(len(wls), PANEL_WORKLOADS) - 0.4)
    ax.margins(y=0.15)
    ax.set_ylabel("HF's time / time" if cpu else "% of copy bandwidth", fontsize=8)
    ax.tick_params(axis="y", labelsize=8)


def write_png(res: dict, path: str, peers: Optional[List[str]] = None) -> Tuple[bool, str]:
    """Grouped bars per workload and implementation, PANEL_WORKLOADS workloads a panel: % of copy
    bandwidth on a GPU run; on a CPU run, how many times faster than the HF-code column (log
    scale). `peers`: only these implementations (names), in that order. Needs matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except Exception as e:
        return False, f"no PNG: matplotlib is not importable ({type(e).__name__}); pip install matplotlib"
    cpu = res["meta"]["cpu_mode"]
    cols = _columns(res)
    if peers is not None:
        cols = [c for name in peers for c in cols if c["name"] == name]
    by = {(r["workload"], r["peer"]): r for r in res["results"]}
    hf = _hf_times(res) if cpu else {}
    wls = [
        w
        for w in res["workloads"]
        if any(_bar_value(by.get((w["id"], c["name"])), hf.get(w["id"]), cpu) is not None for c in cols)
    ]
    panels = [wls[i : i + PANEL_WORKLOADS] for i in range(0, len(wls), PANEL_WORKLOADS)] or [[]]
    size = PLOT_SIZE
    fig, axes = plt.subplots(
        len(panels), 1, figsize=(size["width_in"], size["panel_in"] * len(panels) + 1.0), dpi=size["dpi"], squeeze=False
    )
    for ax, group in zip(axes[:, 0], panels):
        _draw_panel(ax, group, cols, by, hf, cpu)
    what = (
        "times faster than HF's code in torch eager (higher is better)"
        if cpu
        else "% of copy bandwidth (higher is better)"
    )
    title = f"RoPE, {what}: {res['meta']['device']}, {res['meta'].get('date', '')[:10]}"
    if cpu:
        title = "CPU NUMBERS, not GPU: " + title
    if not cpu and any(w["graph"] for w in wls):
        title += "\n* launch-bound size, timed with CUDA-graph replay"
    fig.suptitle(title, fontsize=10)
    handles = [Patch(color=f"C{j}", label=c["label"]) for j, c in enumerate(cols)]
    fig.legend(handles=handles, loc="lower center", ncol=min(len(cols), 5), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.06 if len(cols) <= 5 else 0.1, 1, 0.95))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return True, path


def markdown(res: dict, png: Optional[str] = None) -> str:
    """RESULTS.md: heading, command, plot, the pivot table, details, notes, versions.
    `png` is the plot's path relative to the markdown file."""
    m, c = res["meta"], res["copy"]
    cpu = m["cpu_mode"]
    out = ["# ropekit benchmark results", ""]
    if m.get("partial"):
        out += ["> **Partial run: it stopped before every workload was measured.**", ""]
    if cpu:
        out += ["> **" + CPU_BANNER + "**", ""]
    copy = "" if cpu else f" Copy bandwidth measured in the same run: **{c['gbps']:.0f} GB/s** ({c['what']})."
    out += [
        f"Measured on **{m['device']}** on {m['date']}, bf16.{copy} Sizes: "
        f"{'quick' if m['quick'] else 'full, as in benchmarks/WORKLOADS.md'}.",
        "",
        "Command:",
        "",
        "```",
        m.get("command") or "python -m ropekit.bench",
        "```",
        "",
    ]
    if png:
        what = "time relative to HF's code" if cpu else "percent of copy bandwidth"
        out += [f"![{what} per workload and implementation]({png})", ""]
    lead = (
        "Median time per call and its ratio to the torch eager (HF code) column (below 1.00x is faster)."
        if cpu
        else "Percent of copy bandwidth (higher is better) and median time per call."
    )
    out += [
        f"{lead} Every "
        "implementation's output was checked against a float64 reference before it was timed "
        "(bf16 tolerance: relative error 1e-2); a wrong one is reported, not timed. Rows marked "
        "(graph) are launch-bound sizes timed under CUDA-graph replay over input sets larger "
        "than L2 (W3-1: one input set, 100 calls per graph, the data in L2); 'host per call' is "
        "wall-clock time per eager call.",
        "",
    ]
    header, rows = pivot(res)
    out += [_md_table(header, rows), ""]
    extra = same_size_lines(res) + graph_floor_lines(res) + floor_lines(res) + cpu_speed_lines(res)
    if extra:
        out += ["```"] + extra + ["```", ""]
    out += [
        "## Workloads",
        "",
        "| id | what | sizes | minimal bytes | floor | same-size copy |",
        "|---|---|---|---|---|---|",
    ]
    for w in res["workloads"]:
        sizes = ", ".join(f"{k}={v}" for k, v in w["sizes"].items())
        same = (
            f"{w['same_size_copy_gbps']:.0f} GB/s, {_us(w['same_size_copy_us'])} "
            f"({w['same_size_copy_pct']:.1f}% of copy)"
            if w.get("same_size_copy_gbps") and not cpu
            else "–"
        )
        out.append(
            f"| {w['id']} {w['name']} | {w['what']} | {sizes} | {w['bytes'] / 1e6:.1f} MB | {_us(w['floor_us'])} "
            f"| {same} |"
        )
    out += ["", "## Details", ""]
    dh, dr = details_rows(res)
    out += [_md_table(dh, dr), "", "## Notes", ""]
    out += ["- " + n for n in notes(res)]
    out += ["", "## Versions", ""]
    for k in ("python", "torch", "cuda", "triton", "transformers", "git"):
        if m.get(k):
            out.append(f"- {k}: {m[k]}")
    for p in res["peers"]:
        if p["available"] and p["version"] and p["name"] not in ("reference", "torch-eager", "torch-compile"):
            out.append(f"- {p['label']}: {p['version']}")
    out.append("")
    return "\n".join(out)


def write_markdown(res: dict, path: str, png: Optional[str] = None) -> str:
    """Write RESULTS.md at `path`; `png` (a file path) is referenced relative to it."""
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    rel = os.path.relpath(os.path.abspath(png), d) if png and os.path.exists(png) else None
    with open(path, "w") as f:
        f.write(markdown(res, rel))
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m ropekit.bench.report",
        description="Regenerate the table / RESULTS.md / plot from a saved JSON run.",
    )
    ap.add_argument("json", help="results JSON written by python -m ropekit.bench")
    ap.add_argument("--results-md", metavar="PATH", help="write the markdown here")
    ap.add_argument(
        "--png",
        metavar="PATH",
        help="where the plot is to live (default: next to the markdown); the run's "
        "PNG (the JSON's name with .png) is copied there, or redrawn with --redraw",
    )
    ap.add_argument("--redraw", action="store_true", help="redraw the PNG from the JSON (needs matplotlib)")
    ap.add_argument(
        "--plot-peers",
        metavar="NAMES",
        help="with --redraw: only these implementations in the plot, comma-separated, in this order",
    )
    a = ap.parse_args(argv)
    with open(a.json) as f:
        res = json.load(f)
    print(terminal(res))
    if not a.results_md and not a.png:
        return 0
    run_png = os.path.splitext(a.json)[0] + ".png"
    png = a.png
    if png is None and a.results_md:
        png = os.path.join(os.path.dirname(os.path.abspath(a.results_md)), os.path.basename(run_png))
    os.makedirs(os.path.dirname(os.path.abspath(png)), exist_ok=True)
    if a.redraw:
        peers = [n.strip() for n in a.plot_peers.split(",") if n.strip()] if a.plot_peers else None
        ok, msg = write_png(res, png, peers)
        print(msg)
    elif os.path.exists(run_png) and os.path.abspath(run_png) != os.path.abspath(png):
        shutil.copyfile(run_png, png)
    if a.results_md:
        write_markdown(res, a.results_md, png if os.path.exists(png) else None)
        print(f"wrote {a.results_md}" + (f" (plot: {png})" if os.path.exists(png) else " (no plot)"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
