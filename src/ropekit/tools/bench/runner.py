"""Runs the selected workloads with the selected implementations and returns the results dict
(the same dict that is written as JSON; report.py formats it)."""

from __future__ import annotations

import datetime as _dt
import gc
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import torch

from . import peers as P
from . import timing
from . import workloads as W
from .report import CPU_BANNER, HF_PEER

# A CPU run times every cell in CPU_REPEATS rounds, the peers of a workload in turn each round: a
# burst of load on a shared host then lands on every peer of one round alike, and a ratio to the HF
# column that moves between rounds flags the row (report.py) even when each round's calls agree.
CPU_REPEATS = 3
# A quick CPU run's duration, per cell (workload x peer) and for the rest (copy, floors, the CPU-tensor
# row): measured on a 2-core x86 host, 121 cells in 75-86 s; printed before the run, an estimate only.
CPU_CELL_S, CPU_FIXED_S = 0.6, 8.0


@dataclass
class Config:
    workloads: List[W.Workload]
    peers: Optional[List[str]] = None  # None: every peer (CPU run: the CPU defaults)
    checkpoint: Optional[Callable[[dict], None]] = None  # called with the partial results after each workload
    quick: bool = False
    device: str = "auto"
    warmup_ms: float = 25.0
    rep_ms: float = 100.0
    seed: int = 0
    progress: bool = True
    command: str = ""
    extra: Dict[str, object] = field(default_factory=dict)
    cpu_row: bool = True  # also time ropekit against HF's function on CPU tensors


class Progress:
    """tqdm on stderr when importable, else a plain counter on stderr."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.i, self.enabled, self.bar = total, 0, enabled, None
        if enabled and sys.stderr.isatty():  # a log file gets plain counter lines instead
            try:
                from tqdm.auto import tqdm

                self.bar = tqdm(total=total, file=sys.stderr, unit="run", dynamic_ncols=True)
            except Exception:
                self.bar = None

    def step(self, desc: str):
        self.i += 1
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_description(desc)
        else:
            if self.i == 1:
                self.t0 = time.perf_counter()
            took = time.perf_counter() - self.t0
            eta = f", ~{took / (self.i - 1) * (self.total - self.i + 1):.0f} s left" if self.i > 2 else ""
            print(f"[{self.i}/{self.total} {took:.0f} s{eta}] {desc}", file=sys.stderr, flush=True)

    def done(self):
        if self.bar is not None:
            self.bar.update(1)

    def write(self, msg: str):
        if self.bar is not None:
            self.bar.write(msg, file=sys.stderr)
        else:
            print(msg, file=sys.stderr, flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available")
    return device


def _git_commit() -> Optional[str]:
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        out = subprocess.run(
            ["git", "describe", "--always", "--dirty"], cwd=here, capture_output=True, text=True, timeout=5
        )
        return out.stdout.strip() or None
    except Exception:
        return None


def _meta(device: str, quick: bool, cfg: Config) -> dict:
    cuda = torch.device(device).type == "cuda"
    try:
        import triton

        triton_v = triton.__version__
    except Exception:
        triton_v = None
    return {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": cfg.command,
        "device": torch.cuda.get_device_name(torch.device(device))
        if cuda
        else f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)",
        "cpu_mode": not cuda,
        "quick": quick,
        "dtype": "bfloat16",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda if cuda else None,
        "triton": triton_v,
        "transformers": P.dist_version("transformers"),
        "git": _git_commit(),
        "l2_bytes": timing.l2_bytes(device),
        "triton_interpret": os.environ.get("TRITON_INTERPRET") == "1",
        **cfg.extra,
    }


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _free(device, collect=False):
    if collect:  # slow with transformers loaded: once per workload
        gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def _set_bytes(inp: Dict[str, torch.Tensor]) -> int:
    """Bytes of one input set (excluding the shared table): what a rotation set adds."""
    return sum(t.numel() * t.element_size() for k, t in inp.items() if k != "cache")


def run_one(
    peer: P.Peer, wl: W.Workload, base, exp, extra_sets, nbytes, copy_gbps, device, cfg: Config, keep=None
) -> dict:
    """One cell: the float64 check, then the timing. keep (a dict, CPU runs): given the bound call and
    the first round's samples, for the rounds `cpu_rounds` adds."""
    rec: dict = {
        "workload": wl.id,
        "peer": peer.name,
        "status": None,
        "reason": "",
        "time_us": None,
        "gbps": None,
        "pct_copy": None,
        "pct_same_size_copy": None,
        "host_us": None,
        "time_spread": None,
        "host_spread": None,
        "method": "",
        "rel_err": None,
        "note": "",
    }
    cuda = torch.device(device).type == "cuda"
    try:
        P.forms_only_ropekit(peer, wl)
        peer.begin(wl)
        inp = W.clone_inputs(base)
        bound = peer.make(wl, inp)
    except P.PeerSkip as e:
        rec.update(status=e.status, reason=e.reason)
        return rec
    except Exception as e:
        rec.update(status="error", reason="setup: " + P.short_error(e))
        return rec
    rec["note"] = peer.note(wl)
    # correctness on a fresh copy, before anything is timed
    try:
        out = bound.fn()
        _sync(device)
        got = W.canon(wl, inp, bound.canon(out))
        errs = {name: W.rel_err(got[name], ref) for name, ref in exp.items()}
        tols = check_tolerances(base["q"].dtype, {name: got[name].dtype for name in errs})
        # the check's outputs go before any timing: with autograd (W8) they keep the check's graph,
        # made on the default stream, alive, and a CUDA-graph capture on another stream then fails
        del out, got
    except Exception as e:
        rec.update(status="error", reason="run: " + P.short_error(e))
        return rec
    rec["rel_err"] = {k: (v if v != float("inf") else "nan/inf") for k, v in errs.items()}
    rec["tolerance"] = {k: t for k, (t, _) in tols.items()}
    bad = [k for k in errs if not errs[k] <= tols[k][0]]  # NaN fails too
    if bad:
        k = max(bad, key=lambda k: errs[k] / tols[k][0])
        rec.update(status="wrong", reason=f"{k}: rel err {errs[k]:.3g} > {tols[k][0]:g}, {tols[k][1]}")
        return rec
    loose = sorted(k for k, (t, _) in tols.items() if t > W.tolerance(base["q"].dtype))
    if loose:  # said beside the cell's note: which outputs were checked at their own dtype's error
        worst = max(loose, key=errs.get)
        rec["note"] += f"; {', '.join(loose)} checked {tols[worst][1]} ({tols[worst][0]:g}): worst {errs[worst]:.1e}"
    # timing: min / median / max of every figure, the median shown as the time
    try:
        if not cuda:
            samples = timing.cpu_samples(
                bound.fn, min_s=cfg.rep_ms / 1e3 / CPU_REPEATS, warmup=1 if cfg.warmup_ms > 0 else 0
            )
            st = timing.stats(samples)
            method = "CPU wall clock, median"
            if keep is not None:
                keep.update(bound=bound, rounds=[samples])
        elif wl.graph:
            try:
                if wl.one_set_calls:  # the same inputs every call: they stay in L2
                    st = timing.graph_ms(
                        [bound.fn], cfg.warmup_ms, cfg.rep_ms, all_stats=True, calls_per_set=wl.one_set_calls
                    )
                    method = f"CUDA-graph replay, one input set, {wl.one_set_calls} calls per graph, median"
                else:
                    fns = [bound.fn] + [peer.make(wl, s).fn for s in extra_sets]
                    st = timing.graph_ms(fns, cfg.warmup_ms, cfg.rep_ms, all_stats=True)
                    method = f"CUDA-graph replay over {len(fns)} input sets, median"
            except Exception as e:
                try:
                    torch.cuda.synchronize()
                except Exception:
                    pass
                st = timing.gpu_stats(bound.fn, cfg.warmup_ms, cfg.rep_ms)
                method = f"CUDA events, median (graph capture failed: {P.short_error(e)})"
        else:
            st = timing.gpu_stats(bound.fn, cfg.warmup_ms, cfg.rep_ms)
            method = "CUDA events, median, L2 flushed (triton do_bench)"
        ms = st["median"]
        rec["time_spread"] = {k: (v * 1e3 if k in ("min", "median", "max") else v) for k, v in st.items()}
        if wl.host:
            hs = timing.host_us_stats(
                bound.fn, device, batches=7 if cuda else 3, n=50 if cuda else 3, warmup=5 if cuda else 1
            )
            rec["host_us"], rec["host_spread"] = hs["median"], hs
            if peer.name == "ropekit" and cuda:
                # the launch of the same compiled kernel with prebuilt arguments: the host floor
                # this call's own Python is measured against (the report's 'direct' ratio)
                rec["direct_floor"] = timing.direct_launch_floor(bound.fn, device)
    except Exception as e:
        rec.update(status="error", reason="timing: " + P.short_error(e))
        return rec
    gbps = nbytes / (ms * 1e-3) / 1e9
    rec.update(status="ok", time_us=ms * 1e3, gbps=gbps, pct_copy=100.0 * gbps / copy_gbps, method=method)
    return rec


def check_tolerances(input_dtype: torch.dtype, out_dtypes: Dict[str, torch.dtype]) -> Dict[str, tuple]:
    """Each output's (tolerance, what it was compared with): the inputs' dtype's tolerance, or an
    fp8 output's own (its quantization error: the float64 reference rounded once to fp8, against
    which an implementation that rounds before the fp8 cast lands one fp8 step off here and there)."""
    base = W.tolerance(input_dtype)
    out = {}
    for name, dt in out_dtypes.items():
        own = W.tolerance(dt) if dt.itemsize == 1 and dt.is_floating_point else 0.0
        if own > base:
            out[name] = (own, f"against the float64 reference rounded once to {str(dt)[6:]}, at its quantization error")
        else:
            out[name] = (base, f"against the float64 reference ({str(input_dtype)[6:]} inputs)")
    return out


def run(cfg: Config, log=None) -> dict:
    device = resolve_device(cfg.device)
    cuda = torch.device(device).type == "cuda"
    quick = cfg.quick or not cuda
    peers = P.all_peers()
    if cfg.peers:
        unknown = [n for n in cfg.peers if n not in P.NAMES]
        if unknown:
            raise SystemExit(f"--peers: unknown {', '.join(unknown)} (known: {', '.join(P.NAMES)})")
    peer_info, active = [], []
    for p in peers:
        info = {"name": p.name, "label": p.label, "version": None, "available": False, "reason": ""}
        if cfg.peers is not None and p.name not in cfg.peers:
            info["reason"] = "not selected (--peers)"
        elif cfg.peers is None and not cuda and not p.cpu_default:
            ok, why = p.available(device)
            info["reason"] = why if not ok else ("CPU run: not run by default (pass --peers " + p.name + ")")
        else:
            ok, why = p.available(device)
            info["available"], info["reason"] = ok, why
            if ok:
                info["version"] = p.version()
                active.append(p)
        peer_info.append(info)
        if p.name == "liger" and info["version"]:
            info["label"] = f"Liger-Kernel {info['version']}"

    meta = _meta(device, quick, cfg)
    cells = len(cfg.workloads) * len(active)
    prog = Progress(cells + 1, cfg.progress)
    say = log or prog.write
    if not cuda:
        say(CPU_BANNER)
        say(
            f"{len(cfg.workloads)} workloads x {len(active)} implementations = {cells} cells, each timed in "
            f"{CPU_REPEATS} rounds: expect about {CPU_FIXED_S + CPU_CELL_S * cells:.0f} s on a 2-core CPU "
            "(progress below)"
        )
    prog.step("copy bandwidth")
    copy = timing.copy_bandwidth(
        device, nbytes=(256 << 20) if (quick and cuda) else None, warmup_ms=cfg.warmup_ms, rep_ms=cfg.rep_ms
    )
    prog.done()
    oracle = W.Oracle()
    l2 = timing.l2_bytes(device)
    wl_info, results = [], []
    for wl in cfg.workloads:
        s = wl.sizes(quick)
        if wl.one_set_calls and not cuda:  # a CUDA-graph measurement only: no CPU numbers for it
            why = "CPU run: a CUDA-graph measurement (one input set, many calls per graph)"
            wl_info.append({**_wl_stub(wl, s), "skipped": why})
            for p in active:
                prog.step(f"{wl.id} {p.name}")
                results.append(_empty_rec(wl, p, "skipped", why))
                prog.done()
            continue
        try:
            table = W.make_table(wl, s, device)
            base = W.make_inputs(wl, s, table, device, cfg.seed)
            nbytes = W.min_bytes(wl, base)
            exp = W.expected(wl, base, oracle)
            n_sets = timing.rotation_sets(_set_bytes(base), l2) if (cuda and wl.graph and not wl.one_set_calls) else 1
            extra = [W.make_inputs(wl, s, table, device, cfg.seed + 1 + i) for i in range(n_sets - 1)]
        except Exception as e:  # inputs or oracle failed: every cell is an error
            why = "inputs/oracle: " + P.short_error(e)
            say(f"{wl.id}: {why}")
            wl_info.append(_wl_stub(wl, s))
            for p in active:
                prog.step(f"{wl.id} {p.name}")
                results.append(_empty_rec(wl, p, "error", why))
                prog.done()
            _free(device)
            continue
        wl_info.append(
            {
                "id": wl.id,
                "name": wl.name,
                "what": wl.what,
                "sizes": s,
                "bytes": nbytes,
                "floor_us": nbytes / (copy["gbps"] * 1e9) * 1e6,
                "graph": wl.graph,
                "host": wl.host,
                "input_sets": n_sets,
                "calls_per_graph": wl.one_set_calls or (1 if wl.graph else None),
                "host_floors": _floors(wl, base, say) if (wl.host or wl.kind == "fwdbwd") else None,
                **_same_size(wl, nbytes, copy["gbps"], device, cfg, say),
                "graph_launch_floor": _graph_floor(wl, base, cfg, say) if (cuda and wl.one_set_calls) else None,
            }
        )
        same_gbps = wl_info[-1]["same_size_copy_gbps"]
        kept = {}
        for p in active:
            prog.step(f"{wl.id} {p.name}")
            keep = {} if not cuda else None
            rec = run_one(p, wl, base, exp, extra, nbytes, copy["gbps"], device, cfg, keep)
            if keep:
                kept[p.name] = (rec, keep)
            results.append(rec)
            if rec["status"] in ("wrong", "error"):
                say(f"{wl.id} {p.name}: {rec['status']}: {rec['reason']}")
            prog.done()
            _free(device)
        cpu_rounds(kept, cfg)
        for rec in results[-len(active) :]:
            direct = rec.pop("direct_floor", None)
            if direct is not None and wl_info[-1].get("host_floors") is not None:
                wl_info[-1]["host_floors"]["direct"] = direct if "median" in direct else None
                if "why" in direct:
                    wl_info[-1]["host_floors"]["why"]["direct"] = direct["why"]
        for rec in results[-len(active) :]:
            rec["pct_same_size_copy"] = 100.0 * rec["gbps"] / same_gbps if (same_gbps and rec["gbps"]) else None
        del base, exp, extra, table
        _free(device, collect=True)
        meta["oracle"] = oracle.name
        meta["oracle_disagreements"] = oracle.disagreements
        if cfg.checkpoint is not None:
            cfg.checkpoint(_pack(meta, copy, wl_info, peer_info, results, cuda, partial=True))
    prog.close()
    if cfg.cpu_row:
        try:
            meta["cpu_speed"] = cpu_speed_row(min_s=0.05 if quick else 0.3)
        except Exception as e:
            meta["cpu_speed"] = {"skipped": P.short_error(e)}
    for d in oracle.disagreements:
        say("WARNING oracle disagreement: " + d)
    return _pack(meta, copy, wl_info, peer_info, results, cuda, partial=False)


def cpu_rounds(kept: dict, cfg: Config) -> None:
    """Rounds 2 to CPU_REPEATS of one workload's CPU cells (kept: peer name -> (record, run_one's
    keep)), the peers in turn, every other round in reverse order. A cell's time becomes the median
    of its rounds' medians, its spread that of every call; round_us holds the rounds' medians and,
    beside an HF column that passed, ratio_rounds the round-by-round ratios to it."""
    order = list(kept)
    for r in range(1, CPU_REPEATS):
        for name in order if r % 2 == 0 else order[::-1]:
            _, keep = kept[name]
            keep["rounds"].append(timing.cpu_samples(keep["bound"].fn, min_s=cfg.rep_ms / 1e3 / CPU_REPEATS, warmup=0))
    for rec, keep in kept.values():
        rounds_ms = [statistics.median(s) for s in keep["rounds"]]
        st = timing.stats([t for s in keep["rounds"] for t in s])
        new_us = statistics.median(rounds_ms) * 1e3
        scale = rec["time_us"] / new_us
        rec.update(time_us=new_us, gbps=rec["gbps"] * scale, pct_copy=rec["pct_copy"] * scale)
        rec["time_spread"] = {**{k: st[k] * 1e3 for k in ("min", "max")}, "median": new_us, "n": st["n"]}
        rec["time_spread"]["noisy"] = st["noisy"]
        rec["round_us"] = [m * 1e3 for m in rounds_ms]
        keep.clear()
    hf = kept.get(HF_PEER)
    for rec, _ in kept.values() if hf else ():
        ratios = [a / b for a, b in zip(rec["round_us"], hf[0]["round_us"])]
        rec["ratio_rounds"] = ratios
        rec["ratio_noisy"] = max(ratios) / min(ratios) > timing.SPREAD_FLAG


def _wl_stub(wl: W.Workload, s: Dict[str, int]) -> dict:
    """A workload's entry when nothing of it was measured (skipped, or its inputs failed)."""
    return {
        "id": wl.id,
        "name": wl.name,
        "what": wl.what,
        "sizes": s,
        "bytes": 0,
        "floor_us": 0.0,
        "graph": wl.graph,
        "host": wl.host,
        "input_sets": 0,
        "calls_per_graph": wl.one_set_calls or (1 if wl.graph else None),
        **{k: None for k in SAME_SIZE_KEYS},
        "graph_launch_floor": None,
    }


SAME_SIZE_KEYS = (
    "same_size_copy_gbps",
    "same_size_copy_pct",
    "same_size_copy_us",
    "same_size_copy_bytes",
    "same_size_copy_spread",
)


def _empty_rec(wl: W.Workload, peer: P.Peer, status: str, why: str) -> dict:
    """A cell with no measurement: status 'error' or 'skipped' and why."""
    return {
        "workload": wl.id,
        "peer": peer.name,
        "status": status,
        "reason": why,
        "time_us": None,
        "gbps": None,
        "pct_copy": None,
        "pct_same_size_copy": None,
        "host_us": None,
        "method": "",
        "rel_err": None,
        "note": "",
    }


def _same_size(wl: W.Workload, nbytes: int, copy_gbps: float, device, cfg: Config, say) -> dict:
    """The same-size copy ceiling of a workload timed per call (not a graph row), measured now:
    torch's contiguous copy moving the workload's minimal bytes (timing.same_size_copy). Fields:
    same_size_copy_gbps, same_size_copy_pct (of the big copy), same_size_copy_us and its spread;
    None for graph rows, or when it cannot run (same_size_copy_why says why)."""
    out = {k: None for k in SAME_SIZE_KEYS}
    if wl.graph or nbytes <= 0:
        return out
    try:
        c = timing.same_size_copy(device, nbytes, cfg.warmup_ms, cfg.rep_ms)
    except Exception as e:  # out of memory, say: reported, not faked
        say(f"{wl.id}: same-size copy: {P.short_error(e)}")
        return {**out, "same_size_copy_why": P.short_error(e)}
    finally:
        _free(device)
    return {
        "same_size_copy_gbps": c["gbps"],
        "same_size_copy_pct": 100.0 * c["gbps"] / copy_gbps,
        "same_size_copy_us": c["time_us"],
        "same_size_copy_bytes": c["bytes"],
        "same_size_copy_spread": c["spread"],
    }


def _graph_floor(wl: W.Workload, base, cfg: Config, say) -> Optional[dict]:
    """An empty Triton kernel captured wl.one_set_calls times in one graph, per launch (microseconds)."""
    try:
        return timing.graph_launch_floor(base["q"], wl.one_set_calls, cfg.warmup_ms, cfg.rep_ms)
    except Exception as e:
        say(f"{wl.id}: graph launch floor: {P.short_error(e)}")
        try:
            torch.cuda.synchronize()
        except Exception:
            pass
        return {"why": P.short_error(e)}


def _floors(wl, base, say) -> Optional[dict]:
    """Host floors on this workload's own q (and k), measured now: see timing.host_floors."""
    try:
        return timing.host_floors(base["q"], base.get("k"))
    except Exception as e:  # a floor that cannot run is reported, not faked
        say(f"{wl.id}: host floors: {P.short_error(e)}")
        return None


def cpu_speed_row(dtypes=(torch.bfloat16, torch.float32), B=2, S=128, Hq=32, Hk=8, D=128, min_s=0.3) -> dict:
    """ropekit on CPU tensors (its pure-PyTorch path, no interpreter) against Hugging Face's
    apply_rotary_pos_emb in the same process: median (and spread) of single calls, in microseconds.
    Also ropekit.core.cpu.rotate alone (the CPU path's rotation, without the op's validation and
    memo). Keys: dtype name -> {impl: stats}."""
    import ropekit
    from ropekit.core import cpu

    try:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as hf_apply
    except Exception as e:
        return {"skipped": f"transformers not importable ({P.short_error(e)})"}
    saved = os.environ.pop("TRITON_INTERPRET", None)  # the CPU path users get
    out: dict = {"sizes": dict(B=B, S=S, Hq=Hq, Hk=Hk, D=D)}
    try:
        g = torch.Generator().manual_seed(0)
        inv = 1.0 / 10000.0 ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
        ang = torch.arange(S, dtype=torch.float64)[:, None] * inv
        table = torch.cat((ang.cos(), ang.sin()), -1).float()
        for dt in dtypes:
            # (B, S, H, D) memory, as a model's projections write it; HF's attention hands its rotary
            # function (B, H, S, D) views of that memory (`.view(B, S, H, D).transpose(1, 2)`)
            qs = torch.randn(B, S, Hq, D, generator=g).to(dt)
            ks = torch.randn(B, S, Hk, D, generator=g).to(dt)
            q, k = qs.transpose(1, 2), ks.transpose(1, 2)
            emb = torch.cat((ang, ang), -1)
            cos, sin = emb.cos().to(dt)[None].expand(B, S, D), emb.sin().to(dt)[None].expand(B, S, D)
            row = {
                "hf": timing.stats(
                    [t * 1e3 for t in timing.cpu_samples(lambda: hf_apply(q, k, cos, sin), min_s=min_s, max_reps=400)]
                ),
                "ropekit.apply_rope": timing.stats(
                    [
                        t * 1e3
                        for t in timing.cpu_samples(
                            lambda: ropekit.apply_rope(qs, ks, None, table, layout="bshd"), min_s=min_s, max_reps=400
                        )
                    ]
                ),
            }
            c, s_ = table[:S, : D // 2], table[:S, D // 2 :]
            qo, ko = torch.empty_like(qs), torch.empty_like(ks)

            def both():
                cpu.rotate(qs, qo, c, s_)
                cpu.rotate(ks, ko, c, s_)

            row["ropekit.core.cpu.rotate"] = timing.stats(
                [t * 1e3 for t in timing.cpu_samples(both, min_s=min_s, max_reps=400)]
            )
            out[str(dt).replace("torch.", "")] = row
    finally:
        if saved is not None:
            os.environ["TRITON_INTERPRET"] = saved
    return out


def _pack(meta, copy, wl_info, peer_info, results, cuda, partial):
    return {
        "meta": {**meta, "partial": partial},
        "copy": copy,
        "workloads": list(wl_info),
        "peers": peer_info,
        "results": list(results),
        "cpu_banner": CPU_BANNER if not cuda else None,
    }
