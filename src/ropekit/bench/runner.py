"""Runs the selected workloads with the selected implementations and returns the results dict
(the same dict that is written as JSON; report.py formats it)."""

from __future__ import annotations

import datetime as _dt
import gc
import os
import platform
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import torch

from . import peers as P
from . import timing
from . import workloads as W

CPU_BANNER = ("CPU RUN: no CUDA device was used. These are CPU numbers (pure-PyTorch paths at "
              "quick sizes), not GPU numbers; '% of copy' is against a CPU memcpy.")


@dataclass
class Config:
    workloads: List[W.Workload]
    peers: Optional[List[str]] = None       # None: every peer (CPU run: the CPU defaults)
    checkpoint: Optional[Callable[[dict], None]] = None   # called with the partial results after each workload
    quick: bool = False
    device: str = "auto"
    warmup_ms: float = 25.0
    rep_ms: float = 100.0
    seed: int = 0
    progress: bool = True
    command: str = ""
    extra: Dict[str, object] = field(default_factory=dict)


class Progress:
    """tqdm on stderr when importable, else a plain counter on stderr."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.i, self.enabled, self.bar = total, 0, enabled, None
        if enabled and sys.stderr.isatty():      # a log file gets plain counter lines instead
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
            print(f"[{self.i}/{self.total}] {desc}", file=sys.stderr, flush=True)

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
        out = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=here, capture_output=True,
                             text=True, timeout=5)
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
        "device": torch.cuda.get_device_name(torch.device(device)) if cuda else
                  f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)",
        "cpu_mode": not cuda,
        "quick": quick,
        "dtype": "bfloat16",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda if cuda else None,
        "triton": triton_v,
        "transformers": P._version("transformers"),
        "git": _git_commit(),
        "l2_bytes": timing.l2_bytes(device),
        "triton_interpret": os.environ.get("TRITON_INTERPRET") == "1",
        **cfg.extra,
    }


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _free(device, collect=False):
    if collect:                          # slow with transformers loaded: once per workload
        gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def _set_bytes(inp: Dict[str, torch.Tensor]) -> int:
    """Bytes of one input set (excluding the shared table): what a rotation set adds."""
    return sum(t.numel() * t.element_size() for k, t in inp.items() if k != "cache")


def run_one(peer: P.Peer, wl: W.Workload, base, exp, extra_sets, nbytes, copy_gbps, device,
            cfg: Config) -> dict:
    rec: dict = {"workload": wl.id, "peer": peer.name, "status": None, "reason": "",
                 "time_us": None, "gbps": None, "pct_copy": None, "host_us": None,
                 "method": "", "rel_err": None, "note": ""}
    cuda = torch.device(device).type == "cuda"
    try:
        peer.begin(wl)
        inp = W.clone_inputs(base)
        bound = peer.make(wl, inp)
    except P.PeerSkip as e:
        rec.update(status=e.status, reason=e.reason)
        return rec
    except Exception as e:
        rec.update(status="error", reason="setup: " + P._short(e))
        return rec
    rec["note"] = peer.note(wl)
    # correctness on a fresh copy, before anything is timed
    try:
        out = bound.fn()
        _sync(device)
        got = W.canon(wl, inp, bound.canon(out))
        errs = {name: W.rel_err(got[name], ref) for name, ref in exp.items()}
    except Exception as e:
        rec.update(status="error", reason="run: " + P._short(e))
        return rec
    rec["rel_err"] = {k: (v if v != float("inf") else "nan/inf") for k, v in errs.items()}
    tol = W.tolerance(base["q"].dtype)
    worst = max(errs.values())
    if not worst <= tol:
        bad = max(errs, key=errs.get)
        rec.update(status="wrong", reason=f"{bad}: rel err {worst:.3g} > {tol:g} vs float64 reference")
        return rec
    # timing
    try:
        if not cuda:
            ms = timing.cpu_ms(bound.fn, min_s=cfg.rep_ms / 1e3, warmup=1 if cfg.warmup_ms > 0 else 0)
            method = "CPU wall clock, median"
        elif wl.graph:
            try:
                fns = [bound.fn] + [peer.make(wl, s).fn for s in extra_sets]
                ms = timing.graph_ms(fns, cfg.warmup_ms, cfg.rep_ms)
                method = f"CUDA-graph replay over {len(fns)} input sets, median"
            except Exception as e:
                try:
                    torch.cuda.synchronize()
                except Exception:
                    pass
                ms = timing.gpu_ms(bound.fn, cfg.warmup_ms, cfg.rep_ms)
                method = f"CUDA events, median (graph capture failed: {P._short(e)})"
        else:
            ms = timing.gpu_ms(bound.fn, cfg.warmup_ms, cfg.rep_ms)
            method = "CUDA events, median, L2 flushed (triton do_bench)"
        if cuda and wl.host:
            rec["host_us"] = timing.host_us(bound.fn, device)
    except Exception as e:
        rec.update(status="error", reason="timing: " + P._short(e))
        return rec
    gbps = nbytes / (ms * 1e-3) / 1e9
    rec.update(status="ok", time_us=ms * 1e3, gbps=gbps, pct_copy=100.0 * gbps / copy_gbps,
               method=method)
    return rec


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
            info["reason"] = why if not ok else (
                "CPU run: not run by default (pass --peers " + p.name + ")")
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
    prog = Progress(len(cfg.workloads) * len(active) + 1, cfg.progress)
    say = log or prog.write
    if not cuda:
        say(CPU_BANNER)
    prog.step("copy bandwidth")
    copy = timing.copy_bandwidth(device, nbytes=(256 << 20) if (quick and cuda) else None,
                                 warmup_ms=cfg.warmup_ms, rep_ms=cfg.rep_ms)
    prog.done()
    oracle = W.Oracle()
    l2 = timing.l2_bytes(device)
    wl_info, results = [], []
    for wl in cfg.workloads:
        s = wl.sizes(quick)
        try:
            table = W.make_table(wl, s, device)
            base = W.make_inputs(wl, s, table, device, cfg.seed)
            nbytes = W.min_bytes(wl, base)
            exp = W.expected(wl, base, oracle)
            n_sets = timing.rotation_sets(_set_bytes(base), l2) if (cuda and wl.graph) else 1
            extra = [W.make_inputs(wl, s, table, device, cfg.seed + 1 + i) for i in range(n_sets - 1)]
        except Exception as e:                   # inputs or oracle failed: every cell is an error
            why = "inputs/oracle: " + P._short(e)
            say(f"{wl.id}: {why}")
            wl_info.append({"id": wl.id, "name": wl.name, "what": wl.what, "sizes": s, "bytes": 0,
                            "floor_us": 0.0, "graph": wl.graph, "host": wl.host, "input_sets": 0})
            for p in active:
                prog.step(f"{wl.id} {p.name}")
                results.append({"workload": wl.id, "peer": p.name, "status": "error", "reason": why,
                                "time_us": None, "gbps": None, "pct_copy": None, "host_us": None,
                                "method": "", "rel_err": None, "note": ""})
                prog.done()
            _free(device)
            continue
        wl_info.append({"id": wl.id, "name": wl.name, "what": wl.what, "sizes": s, "bytes": nbytes,
                        "floor_us": nbytes / (copy["gbps"] * 1e9) * 1e6, "graph": wl.graph,
                        "host": wl.host, "input_sets": n_sets})
        for p in active:
            prog.step(f"{wl.id} {p.name}")
            rec = run_one(p, wl, base, exp, extra, nbytes, copy["gbps"], device, cfg)
            results.append(rec)
            if rec["status"] in ("wrong", "error"):
                say(f"{wl.id} {p.name}: {rec['status']}: {rec['reason']}")
            prog.done()
            _free(device)
        del base, exp, extra, table
        _free(device, collect=True)
        meta["oracle"] = oracle.name
        meta["oracle_disagreements"] = oracle.disagreements
        if cfg.checkpoint is not None:
            cfg.checkpoint(_pack(meta, copy, wl_info, peer_info, results, cuda, partial=True))
    prog.close()
    for d in oracle.disagreements:
        say("WARNING oracle disagreement: " + d)
    return _pack(meta, copy, wl_info, peer_info, results, cuda, partial=False)


def _pack(meta, copy, wl_info, peer_info, results, cuda, partial):
    return {"meta": {**meta, "partial": partial}, "copy": copy, "workloads": list(wl_info),
            "peers": peer_info, "results": list(results),
            "cpu_banner": CPU_BANNER if not cuda else None}
