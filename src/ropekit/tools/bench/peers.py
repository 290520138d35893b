"""The implementations a workload is run with: ropekit and its peers.

One small adapter per implementation. `make(workload, inputs)` does the untimed setup (builds the
cos/sin a peer takes from the same angle table, views, flattening) and returns a `Bound`: the
call to time, and how to turn its raw outputs into the workload's canonical outputs (see
workloads.py) for the float64 check. A peer that lacks the op raises PeerSkip("n/a", why); an
op not written yet gives PeerSkip("skipped", why). Peers that are not importable are listed as
skipped with the import error, never faked.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from . import workloads as W


class PeerSkip(Exception):
    def __init__(self, status: str, reason: str):
        super().__init__(reason)
        self.status = status  # "n/a" (the peer has no such op) or "skipped"
        self.reason = reason


@dataclass
class Bound:
    fn: Callable[[], Any]  # the timed call
    canon: Callable[[Any], Tuple[torch.Tensor, ...]]  # raw outputs -> canonical tuple (untimed)


def dist_version(*dists: str) -> Optional[str]:
    for d in dists:
        try:
            return importlib.metadata.version(d)
        except Exception:
            continue
    return None


def short_error(e: BaseException) -> str:
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {msg}"[:200]


def importable(module: str) -> Tuple[bool, str]:
    """(True, "") when module imports, else (False, why): a peer's `available` answer."""
    try:
        importlib.import_module(module)
        return True, ""
    except Exception as e:
        return False, f"not importable ({short_error(e)})"


class Peer:
    name = ""
    label = ""
    needs_cuda = True  # only meaningful on a GPU
    cpu_default = False  # run by default on a machine without CUDA

    def available(self, device) -> Tuple[bool, str]:
        return True, ""

    def version(self) -> Optional[str]:
        return None

    def begin(self, wl: W.Workload) -> None:
        """Called once per workload before its make() calls."""

    def make(self, wl: W.Workload, inp: Dict[str, torch.Tensor]) -> Bound:
        raise NotImplementedError

    def note(self, wl: W.Workload) -> str:
        """Which function ran (after make)."""
        return ""


# ------------------------------------------------------------------------------------------
# Hugging Face-style helpers, shared by torch eager, torch.compile and Liger


def hf_cos_sin(wl: W.Workload, inp, dtype, *, mrope3: bool = False):
    """cos, sin as an HF rotary embedding returns them: halves duplicated, in the activation
    dtype, (B, S, D) for the positions HF holds. M-RoPE: (3, B, S, D) when mrope3, else the
    frequency sections recomposed into (B, S, D) (what transformers 5.x does in the module)."""
    tab = inp["cache"]
    half = tab.shape[-1] // 2
    rows = tab[W.hf_positions(wl, inp)]
    cos, sin = rows[..., :half], rows[..., half:]
    if wl.mrope_section is not None and not mrope3:
        t, h, w = wl.mrope_section
        sec = torch.tensor([0] * t + [1] * h + [2] * w, device=tab.device)
        pick = sec.view(1, 1, 1, half).expand(1, *cos.shape[1:])
        cos, sin = cos.gather(0, pick).squeeze(0), sin.gather(0, pick).squeeze(0)
    return torch.cat((cos, cos), -1).to(dtype), torch.cat((sin, sin), -1).to(dtype)


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def plain_hf_apply(q, k, cos, sin, unsqueeze_dim=1):
    """The rotate_half formula of HF's apply_rotary_pos_emb, in plain torch (used when
    transformers is not importable)."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def plain_llama4_apply(xq, xk, freqs_cis):
    """Llama 4's complex-multiply RoPE in plain torch (xq (B, S, H, D), freqs_cis (B, S, D/2))."""
    f = freqs_cis[:, :, None, :]
    oq = torch.view_as_real(torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2)) * f)
    ok = torch.view_as_real(torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2)) * f)
    return oq.flatten(3).type_as(xq), ok.flatten(3).type_as(xk)


def mla_inplace(q_pe, k_pe, cos, sin):
    """Interleaved (GPT-J pairs) rotation written back in place with copy_; cos/sin (T, 1, D/2).
    HF's DeepSeek-V3 code de-interleaves and concatenates instead (another output layout)."""
    for x in (q_pe, k_pe):
        x1, x2 = x[..., 0::2], x[..., 1::2]
        x.copy_(torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2))
    return q_pe, k_pe


def make_store_unfused(apply):
    """The unfused store: HF rope, then index_copy of k and v into the flat cache rows."""

    def store(q_hf, k_hf, v, cos, sin, k_rows, v_rows, slots):
        qo, ko = apply(q_hf, k_hf, cos, sin)
        k_rows.index_copy_(0, slots, ko.transpose(1, 2).squeeze(0))
        v_rows.index_copy_(0, slots, v)
        return qo

    return store


def _half_table(inp, dtype):
    tab = inp["cache"]
    half = tab.shape[-1] // 2
    return tab[:, :half].to(dtype).contiguous(), tab[:, half:].to(dtype).contiguous()


def _grad_fn(forward, q, k, gq, gk):
    """forward(q, k) -> (qo, ko); then autograd.grad to q, k with the given output grads."""

    def fn():
        qo, ko = forward(q, k)
        dq, dk = torch.autograd.grad((qo, ko), (q, k), (gq, gk))
        return qo, ko, dq, dk

    return fn


# ------------------------------------------------------------------------------------------
# ropekit and its pure-PyTorch reference


class Ropekit(Peer):
    name = "ropekit"
    label = "ropekit"
    needs_cuda = False
    cpu_default = True
    module = "ropekit"

    def _mod(self):
        return importlib.import_module(self.module)

    def available(self, device):
        try:
            self._mod()
            return True, ""
        except Exception as e:
            return False, f"not importable ({short_error(e)})"

    def version(self):
        try:
            return getattr(importlib.import_module("ropekit"), "__version__", None)
        except Exception:
            return None

    def _op(self, name):
        op = getattr(self._mod(), name, None)
        if op is None:
            raise PeerSkip("skipped", f"{self.module}.{name} not implemented yet")
        return op

    def make(self, wl, inp):
        if wl.kind in W.NORM_KINDS:  # W9 / W10: see norm_make
            return norm_make(self, wl, inp)
        il, ms = wl.interleaved, wl.mrope_section
        pos, cache = inp.get("positions"), inp["cache"]
        ident = lambda o: tuple(o)  # noqa: E731
        if wl.rope_forms:
            return rope_form(self._op("apply_rope"), wl, inp)
        if wl.kind == "rope":
            op = self._op("apply_rope")
            q, k = inp["q"], inp["k"]
            if wl.mrope_layout is not None:
                ml = wl.mrope_layout
                return Bound(lambda: op(q, k, pos, cache, interleaved=il, mrope_section=ms, mrope_layout=ml), ident)
            return Bound(lambda: op(q, k, pos, cache, interleaved=il, mrope_section=ms), ident)
        if wl.kind == "mla":
            op = self._op("apply_rope")
            R = inp["k_pe"].shape[-1]
            q_pe, k_pe = inp["q"][..., -R:], inp["k_pe"]
            return Bound(
                lambda: op(q_pe, k_pe, pos, cache, interleaved=il, inplace=True), lambda o: (inp["q"], inp["k_pe"])
            )
        if wl.kind == "store":
            op = self._op("apply_rope_and_store")
            q, k, v, kc, vc, slots = (inp[n] for n in ("q", "k", "v", "k_cache", "v_cache", "slots"))
            if "k_nope" in wl.store_forms:
                return store_parts_form(op, wl, inp)
            if "nvfp4" in wl.store_forms:
                return store_nvfp4_form(op, wl, inp)
            if "write_key" in wl.store_forms:
                return Bound(
                    lambda: op(q, k, v, pos, cache, kc, vc, slots, interleaved=il, write_key=True),
                    lambda o: (q, kc, vc, k),
                )
            return Bound(lambda: op(q, k, v, pos, cache, kc, vc, slots, interleaved=il), lambda o: (q, kc, vc))
        # fwdbwd
        op = self._op("apply_rope")
        q, k = inp["q"].requires_grad_(), inp["k"].requires_grad_()
        fwd = lambda q_, k_: op(q_, k_, pos, cache, interleaved=il)  # noqa: E731
        return Bound(_grad_fn(fwd, q, k, inp["gq"], inp["gk"]), ident)

    def note(self, wl):
        return f"{self.module}.{'apply_rope_and_store' if wl.kind in ('store', 'normstore') else 'apply_rope'}"


def rope_form(op, wl: W.Workload, inp) -> Bound:
    """apply_rope in one of its conventions (Workload.rope_forms) on the plain row's inputs: the
    layouts the convention takes are made here (untimed), the canonical outputs in the plain row's
    layout."""
    il, pos, cache = wl.interleaved, inp.get("positions"), inp["cache"]
    form = wl.rope_forms[0]
    if form == "last":  # MLA's whole q: the rotated dims are the last R, in place
        q, k_pe = inp["q"], inp["k_pe"]
        fn = lambda: op(q, k_pe, pos, cache, interleaved=il, rotary_position="last", inplace=True)  # noqa: E731
        return Bound(fn, lambda o: (q, k_pe))
    q, k = inp["q"], inp["k"]
    if form == "sbhd":  # Transformer Engine's (S, B, H, D), contiguous; positions None: arange over S
        q_s, k_s = q.transpose(0, 1).contiguous(), k.transpose(0, 1).contiguous()
        fn = lambda: op(q_s, k_s, None, cache, interleaved=il, layout="sbhd")  # noqa: E731
        return Bound(fn, lambda o: (o[0].transpose(0, 1), o[1].transpose(0, 1)))
    if form == "out":  # the caller's buffers
        q_out, k_out = torch.empty_like(q), torch.empty_like(k)
        fn = lambda: op(q, k, pos, cache, interleaved=il, q_out=q_out, k_out=k_out)  # noqa: E731
        return Bound(fn, tuple)
    if form == "head_table":  # the plain call: the table's rank says it is per head
        return Bound(lambda: op(q, k, pos, cache, interleaved=il), tuple)
    if form == "eager":
        return Bound(lambda: op(q, k, pos, cache, interleaved=il, eager_rounding=True), tuple)
    if form == "q_temperature":
        return Bound(lambda: op(q, k, pos, cache, interleaved=il, q_temperature=W.Q_TEMPERATURE), tuple)
    # "strided": every other element of a buffer twice as wide
    q_2, k_2 = (torch.empty(*x.shape[:-1], 2 * x.shape[-1], dtype=x.dtype, device=x.device) for x in (q, k))
    q_2[..., ::2], k_2[..., ::2] = q, k
    q_s, k_s = q_2[..., ::2], k_2[..., ::2]
    return Bound(lambda: op(q_s, k_s, pos, cache, interleaved=il), tuple)


def store_parts_form(op, wl: W.Workload, inp) -> Bound:
    """apply_rope_and_store with k (and with "q_nope" q) given as FlashInfer's rope and no-rope
    parts: views of the rows of the plain inputs (R = the table's width), q_nope into q_out."""
    R = inp["cache"].shape[-1]
    q, k, v, kc, vc, slots = (inp[n] for n in ("q", "k", "v", "k_cache", "v_cache", "slots"))
    pos, cache = inp.get("positions"), inp["cache"]
    kw = dict(interleaved=wl.interleaved, k_nope=k[..., R:])
    if "q_nope" not in wl.store_forms:
        return Bound(lambda: op(q, k[..., :R], v, pos, cache, kc, vc, slots, **kw), lambda o: (q, kc, vc))
    q_out = inp["q_out"]
    kw.update(q_nope=q[..., R:], q_out=q_out, q_scale=W.Q_SCALE)
    return Bound(lambda: op(q[..., :R], k[..., :R], v, pos, cache, kc, vc, slots, **kw), lambda o: (q_out, kc, vc))


def store_nvfp4_form(op, wl: W.Workload, inp) -> Bound:
    """apply_rope_and_store into NVFP4 caches (codes and block scales), global scales
    W.NVFP4_GLOBAL; the canonical caches are their unpacked float64 values."""
    q, k, v, kc, vc, slots = (inp[n] for n in ("q", "k", "v", "k_cache", "v_cache", "slots"))
    pos, cache, g = inp.get("positions"), inp["cache"], W.NVFP4_GLOBAL
    ks, vs = inp["k_cache_scales"], inp["v_cache_scales"]
    kw = dict(interleaved=wl.interleaved, k_scale=g, v_scale=g, k_cache_scales=ks, v_cache_scales=vs)
    return Bound(
        lambda: op(q, k, v, pos, cache, kc, vc, slots, **kw),
        lambda o: (q, W.nvfp4_values(inp, kc, ks), W.nvfp4_values(inp, vc, vs)),
    )


class Reference(Ropekit):
    name = "reference"
    label = "ropekit reference (PyTorch)"
    module = "ropekit.tools.reference"


# ------------------------------------------------------------------------------------------
# torch eager (the HF code) and torch.compile of it


class TorchEager(Peer):
    name = "torch-eager"
    label = "torch eager (HF code)"
    needs_cuda = False
    cpu_default = True

    def __init__(self):
        self._fns: Dict[str, Any] = {}
        self._notes: Dict[str, str] = {}

    def version(self):
        return torch.__version__

    def fns(self, keys=("apply", "llama4", "mrope", "mla")) -> Dict[str, Any]:
        """key -> (function, note), resolved (and imported) on first use only."""
        for key in keys:
            if key not in self._fns:
                self._fns.update(self._resolve(key))
        return self._fns

    def _resolve(self, key: str) -> Dict[str, Any]:
        """transformers' own functions where importable, else the same formulas in plain torch."""
        tv = dist_version("transformers")
        if key == "apply":
            try:
                from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

                return {
                    "apply": (
                        apply_rotary_pos_emb,
                        f"transformers {tv} models.llama.modeling_llama.apply_rotary_pos_emb",
                    )
                }
            except Exception as e:
                return {
                    "apply": (
                        plain_hf_apply,
                        f"bench's plain-torch rotate_half formula (transformers not importable: {short_error(e)})",
                    )
                }
        if key == "llama4":
            try:
                from transformers.models.llama4.modeling_llama4 import apply_rotary_emb

                return {
                    "llama4": (apply_rotary_emb, f"transformers {tv} models.llama4.modeling_llama4.apply_rotary_emb")
                }
            except Exception:
                return {"llama4": (plain_llama4_apply, "bench's plain-torch Llama-4 complex formula")}
        if key == "mrope":
            try:
                from transformers.models.qwen2_vl import modeling_qwen2_vl as q2

                if hasattr(q2, "apply_multimodal_rotary_pos_emb"):  # transformers 4.x
                    return {
                        "mrope4": True,
                        "mrope": (
                            q2.apply_multimodal_rotary_pos_emb,
                            f"transformers {tv} qwen2_vl.apply_multimodal_rotary_pos_emb "
                            "(sections picked inside the timed call)",
                        ),
                    }
                return {
                    "mrope4": False,
                    "mrope": (  # 5.x: sections in the module
                        q2.apply_rotary_pos_emb,
                        f"transformers {tv} qwen2_vl.apply_rotary_pos_emb (5.x: sections "
                        "recomposed by the rotary-embedding module, outside the timed call)",
                    ),
                }
            except Exception:
                return {"mrope4": False, "mrope": (plain_hf_apply, "bench's plain-torch formula on recomposed cos/sin")}
        return {
            "mla": (
                mla_inplace,
                "bench's plain-torch interleaved formula, in place via copy_ "
                "(HF's DeepSeek-V3 code writes another layout)",
            )
        }

    @staticmethod
    def _keys(wl):
        if wl.kind == "mla":
            return ("mla",)
        if wl.interleaved:
            return ("llama4",)
        return ("mrope",) if wl.mrope_section is not None else ("apply",)

    def wrap(self, wl, key, fn):
        return fn

    def make(self, wl, inp):
        if wl.kind in W.NORM_KINDS:  # W9 / W10: see norm_make
            return norm_make(self, wl, inp)
        if wl.mrope_layout is not None:
            raise PeerSkip("n/a", f"HF's multimodal rotation takes (t, h, w) chunks, not {wl.mrope_layout!r}")
        F = self.fns(self._keys(wl))
        for key in self._keys(wl):
            if F[key][0] is None:  # (None, (status, reason)): not there
                raise PeerSkip(*F[key][1])
        dt = inp["q"].dtype
        if wl.kind == "mla":
            fn, note = F["mla"]
            fn = self.wrap(wl, "mla", fn)
            R = inp["k_pe"].shape[-1]
            c, s = _half_table(inp, dt)
            pos = inp["positions"]
            cos, sin = c[pos].unsqueeze(1), s[pos].unsqueeze(1)  # (T, 1, R/2)
            q_pe, k_pe = inp["q"][..., -R:], inp["k_pe"]
            self._notes[wl.id] = note
            return Bound(lambda: fn(q_pe, k_pe, cos, sin), lambda o: (inp["q"], inp["k_pe"]))
        if wl.interleaved:  # W5: Llama 4
            fn, note = F["llama4"]
            fn = self.wrap(wl, "llama4", fn)
            tab = inp["cache"]
            half = tab.shape[-1] // 2
            rows = tab[W.hf_positions(wl, inp)]  # (1, T, D)
            freqs = torch.complex(rows[..., :half].float(), rows[..., half:].float())
            xq, xk = inp["q"].unsqueeze(0), inp["k"].unsqueeze(0)
            self._notes[wl.id] = note
            return Bound(lambda: fn(xq, xk, freqs), lambda o: (o[0].squeeze(0), o[1].squeeze(0)))
        q_hf, k_hf = W.to_hf(wl, inp["q"]), W.to_hf(wl, inp["k"])
        back = lambda o: (W.from_hf(wl, o[0]), W.from_hf(wl, o[1]))  # noqa: E731
        if wl.mrope_section is not None:  # W4
            fn, note = F["mrope"]
            fn = self.wrap(wl, "mrope", fn)
            self._notes[wl.id] = note
            if F["mrope4"]:
                cos, sin = hf_cos_sin(wl, inp, dt, mrope3=True)
                sec = list(wl.mrope_section)
                return Bound(lambda: fn(q_hf, k_hf, cos, sin, sec), back)
            cos, sin = hf_cos_sin(wl, inp, dt)
            return Bound(lambda: fn(q_hf, k_hf, cos, sin), back)
        apply, note = F["apply"]
        self._notes[wl.id] = note
        cos, sin = hf_cos_sin(wl, inp, dt)
        if wl.kind == "rope":
            fn = self.wrap(wl, "apply", apply)
            return Bound(lambda: fn(q_hf, k_hf, cos, sin), back)
        if wl.kind == "store":
            self._notes[wl.id] = "unfused: " + note + ", then index_copy_ of k and v into the cache"
            fn = self.wrap(wl, "store", make_store_unfused(apply))
            kc, vc = inp["k_cache"], inp["v_cache"]
            k_rows, v_rows = kc.view(-1, *kc.shape[2:]), vc.view(-1, *vc.shape[2:])
            v, slots = inp["v"], inp["slots"]
            return Bound(
                lambda: fn(q_hf, k_hf, v, cos, sin, k_rows, v_rows, slots), lambda o: (W.from_hf(wl, o), kc, vc)
            )
        # fwdbwd: autograd through the HF function
        fn = self.wrap(wl, "apply", apply)
        q, k = inp["q"].requires_grad_(), inp["k"].requires_grad_()
        fwd = lambda q_, k_: fn(W.to_hf(wl, q_), W.to_hf(wl, k_), cos, sin)  # noqa: E731
        gq, gk = W.to_hf(wl, inp["gq"]), W.to_hf(wl, inp["gk"])
        return Bound(_grad_fn(fwd, q, k, gq, gk), lambda o: (W.from_hf(wl, o[0]), W.from_hf(wl, o[1]), o[2], o[3]))

    def note(self, wl):
        return self._notes.get(wl.id, "")


class TorchCompile(TorchEager):
    name = "torch-compile"
    label = "torch.compile (HF code)"
    cpu_default = False  # inductor's C++ build is slow on a small CPU: ask for it by name

    def __init__(self):
        super().__init__()
        self._compiled: Dict[str, Any] = {}

    def begin(self, wl):
        # A fresh dynamo state per workload: every workload compiles the same few functions at
        # new shapes, and the per-code-object recompile limit must not send one back to eager.
        import torch._dynamo

        torch._dynamo.reset()
        cfg = torch._dynamo.config
        for attr in ("recompile_limit", "cache_size_limit"):
            if hasattr(cfg, attr):
                setattr(cfg, attr, max(64, getattr(cfg, attr)))
        self._compiled = {}

    def wrap(self, wl, key, fn):
        if key not in self._compiled:
            self._compiled[key] = torch.compile(fn, dynamic=False)
        return self._compiled[key]

    def note(self, wl):
        n = super().note(wl)
        return f"torch.compile(dynamic=False) of {n}" if n else ""


class RopekitHF(TorchEager):
    """ropekit.hf's drop-ins, called exactly as the HF code is called (same cos/sin inputs)."""

    name = "ropekit-hf"
    label = "ropekit.hf drop-in"
    cpu_default = False

    def available(self, device):
        return importable("ropekit.hf")

    def version(self):
        return None

    def _resolve(self, key):
        if key == "mla":
            return {"mla": (None, ("n/a", "no in-place strided-slice drop-in (that is ropekit.apply_rope)"))}
        hf = importlib.import_module("ropekit.hf")
        name = {
            "apply": "apply_rotary_pos_emb",
            "llama4": "llama4_apply_rotary_emb",
            "mrope": "apply_multimodal_rotary_pos_emb",
        }[key]
        f = getattr(hf, name, None)
        entry = (
            (f, f"ropekit.hf.{name}")
            if f is not None
            else (None, ("skipped", f"ropekit.hf.{name} not implemented yet"))
        )
        return {key: entry, "mrope4": True} if key == "mrope" else {key: entry}

    def make(self, wl, inp):
        if wl.kind in W.NORM_KINDS:  # W9 / W10: see norm_make
            return norm_make(self, wl, inp)
        if wl.kind == "store":
            raise PeerSkip("n/a", "no KV-cache store in HF's code (see ropekit-unfused)")
        return super().make(wl, inp)


class RopekitUnfused(Ropekit):
    """The unfused store path of W7's target: ropekit.apply_rope, then index_copy into the cache."""

    name = "ropekit-unfused"
    label = "ropekit apply_rope + index_copy"
    cpu_default = False

    def make(self, wl, inp):
        if wl.kind in W.NORM_KINDS:  # W9 / W10: see norm_make
            return norm_make(self, wl, inp)
        if wl.kind != "store":
            raise PeerSkip("n/a", "only for the store workloads (W7)")
        op = self._op("apply_rope")
        q, k, v, kc, vc, slots = (inp[n] for n in ("q", "k", "v", "k_cache", "v_cache", "slots"))
        pos, cache, il = inp.get("positions"), inp["cache"], wl.interleaved
        k_rows, v_rows = kc.view(-1, *kc.shape[2:]), vc.view(-1, *vc.shape[2:])

        def fn():
            qo, ko = op(q, k, pos, cache, interleaved=il)
            k_rows.index_copy_(0, slots, ko)
            v_rows.index_copy_(0, slots, v)
            return qo

        return Bound(fn, lambda o: (o, kc, vc))

    def note(self, wl):
        return "ropekit.apply_rope, then index_copy_ of k and v into the cache"


class RopekitCuSeqlens(Ropekit):
    """W11: positions derived inside the kernel from cu_seqlens (apply_rope(..., cu_seqlens=...)).
    The plain `ropekit` peer times the same tokens with explicit positions."""

    name = "ropekit-cu"
    label = "ropekit cu_seqlens"
    cpu_default = False  # ask for it by name on CPU (-p ropekit,ropekit-cu)

    def make(self, wl, inp):
        if wl.packed is None:
            raise PeerSkip("n/a", "only for the packed workloads (W11)")
        op = self._op("apply_rope")
        q, k, cu, cache = inp["q"], inp["k"], inp["cu_seqlens"], inp["cache"]
        cp_size = wl.packed[1]
        return Bound(lambda: op(q, k, None, cache, cu_seqlens=cu, cp_size=cp_size, cp_rank=0), lambda o: tuple(o))

    def note(self, wl):
        return f"ropekit.apply_rope(q, k, None, cache, cu_seqlens=cu, cp_size={wl.packed[1] if wl.packed else 1})"


def gather_hf_apply(q, k, cache, positions):
    """Positions gather + HF's rotate_half formula, all inside the call: (1, H, T, D) q and k."""
    half = cache.shape[-1] // 2
    rows = cache[positions]  # (1, T, rotary_dim)
    cos = torch.cat((rows[..., :half], rows[..., :half]), -1).to(q.dtype)
    sin = torch.cat((rows[..., half:], rows[..., half:]), -1).to(q.dtype)
    return plain_hf_apply(q, k, cos, sin)


class TorchCompileGather(Peer):
    """W11 peer: torch.compile of the positions gather and the HF formula together (what a
    compiled packed-sequence model does with position_ids)."""

    name = "torch-compile-gather"
    label = "torch.compile (gather + HF formula)"
    needs_cuda = False
    cpu_default = False

    def version(self):
        return torch.__version__

    def begin(self, wl):
        import torch._dynamo

        torch._dynamo.reset()

    def make(self, wl, inp):
        if wl.packed is None:
            raise PeerSkip("n/a", "only for the packed workloads (W11)")
        fn = torch.compile(gather_hf_apply, dynamic=False)
        q_hf, k_hf = W.to_hf(wl, inp["q"]), W.to_hf(wl, inp["k"])
        pos, cache = inp["positions"].unsqueeze(0), inp["cache"]
        return Bound(lambda: fn(q_hf, k_hf, cache, pos), lambda o: (W.from_hf(wl, o[0]), W.from_hf(wl, o[1])))

    def note(self, wl):
        return "torch.compile(dynamic=False) of cache[positions] -> cos/sin -> rotate_half formula"


# ------------------------------------------------------------------------------------------
# Liger-Kernel


def _cuda_module_available(device, module):
    """(available, reason) of a CUDA-only peer whose code lives in module."""
    if torch.device(device).type != "cuda":
        return False, "needs CUDA"
    try:
        importlib.import_module(module)
        return True, ""
    except Exception as e:
        return False, f"not importable ({short_error(e)})"


class Liger(Peer):
    name = "liger"
    label = "Liger-Kernel"

    def __init__(self):
        self._notes: Dict[str, str] = {}

    def available(self, device):
        return _cuda_module_available(device, "liger_kernel.ops.rope")

    def version(self):
        return dist_version("liger-kernel", "liger_kernel")

    def make(self, wl, inp):
        if wl.kind in W.NORM_KINDS:  # W9 / W10: see norm_make
            return norm_make(self, wl, inp)
        dt = inp["q"].dtype
        if wl.kind in ("mla", "store"):
            raise PeerSkip(
                "n/a",
                "no such op in Liger (needs contiguous q; no KV-cache store)"
                if wl.kind == "mla"
                else "no fused KV-cache store in Liger",
            )
        q_hf, k_hf = W.to_hf(wl, inp["q"]), W.to_hf(wl, inp["k"])
        back = lambda o: (W.from_hf(wl, o[0]), W.from_hf(wl, o[1]))  # noqa: E731
        if wl.interleaved:
            try:
                from liger_kernel.transformers.llama4_rope import liger_llama4_text_rotary_pos_emb as fn

                self._notes[wl.id] = "liger_kernel.transformers.llama4_rope.liger_llama4_text_rotary_pos_emb"
            except Exception:
                from liger_kernel.ops.llama4_rope import LigerLlama4RopeFunction

                fn = LigerLlama4RopeFunction.apply
                self._notes[wl.id] = "liger_kernel.ops.llama4_rope.LigerLlama4RopeFunction"
            tab = inp["cache"]
            half = tab.shape[-1] // 2
            rows = tab[W.hf_positions(wl, inp)]
            freqs = torch.complex(rows[..., :half].float(), rows[..., half:].float())
            xq, xk = inp["q"].unsqueeze(0), inp["k"].unsqueeze(0)
            return Bound(lambda: fn(xq, xk, freqs), lambda o: (o[0].squeeze(0), o[1].squeeze(0)))
        if wl.mrope_layout is not None:
            raise PeerSkip("n/a", f"Liger's M-RoPE is Qwen2-VL's three chunks, not {wl.mrope_layout!r}")
        if wl.mrope_section is not None:
            try:
                from liger_kernel.transformers.qwen2vl_mrope import liger_multimodal_rotary_pos_emb as fn

                self._notes[wl.id] = "liger_kernel.transformers.qwen2vl_mrope.liger_multimodal_rotary_pos_emb"
            except Exception:
                from liger_kernel.ops.qwen2vl_mrope import LigerQwen2VLMRopeFunction

                fn = LigerQwen2VLMRopeFunction.apply
                self._notes[wl.id] = "liger_kernel.ops.qwen2vl_mrope.LigerQwen2VLMRopeFunction"
            cos, sin = hf_cos_sin(wl, inp, dt, mrope3=True)
            sec = list(wl.mrope_section)
            return Bound(lambda: fn(q_hf, k_hf, cos, sin, sec), back)
        try:
            from liger_kernel.transformers.rope import liger_rotary_pos_emb as fn

            self._notes[wl.id] = "liger_kernel.transformers.rope.liger_rotary_pos_emb"
        except Exception:
            from liger_kernel.ops.rope import LigerRopeFunction

            fn = LigerRopeFunction.apply
            self._notes[wl.id] = "liger_kernel.ops.rope.LigerRopeFunction"
        cos, sin = hf_cos_sin(wl, inp, dt)
        if wl.kind == "rope":
            return Bound(lambda: fn(q_hf, k_hf, cos, sin), back)
        q, k = inp["q"].requires_grad_(), inp["k"].requires_grad_()
        fwd = lambda q_, k_: fn(W.to_hf(wl, q_), W.to_hf(wl, k_), cos, sin)  # noqa: E731
        gq, gk = W.to_hf(wl, inp["gq"]), W.to_hf(wl, inp["gk"])
        return Bound(_grad_fn(fwd, q, k, gq, gk), lambda o: (W.from_hf(wl, o[0]), W.from_hf(wl, o[1]), o[2], o[3]))

    def note(self, wl):
        return self._notes.get(wl.id, "") + " (rotates q/k in place)" if wl.id in self._notes else ""


# ------------------------------------------------------------------------------------------
# FlashInfer, vLLM, flash-attn


def _flat_positions(wl, inp):
    if wl.layout == "bshd":
        B, S = inp["q"].shape[:2]
        return torch.arange(S, device=inp["q"].device).repeat(B)
    return inp["positions"]


class FlashInfer(Peer):
    name = "flashinfer"
    label = "FlashInfer"

    def available(self, device):
        return _cuda_module_available(device, "flashinfer.rope")

    def version(self):
        return dist_version("flashinfer-python", "flashinfer")

    def make(self, wl, inp):
        if wl.kind in W.NORM_KINDS:  # W9 / W10: see norm_make
            return norm_make(self, wl, inp)
        if wl.kind != "rope" or wl.mrope_section is not None:
            raise PeerSkip(
                "n/a",
                {
                    "mla": "needs (nnz, H*D)-flattenable q; W6 is a strided slice",
                    "store": "no fused store with this cache layout",
                    "fwdbwd": "no autograd",
                }.get(wl.kind, "no M-RoPE op"),
            )
        from flashinfer.rope import apply_rope_with_cos_sin_cache as fn

        q, k = inp["q"], inp["k"]
        D = q.shape[-1]
        n = q.shape[:-2].numel()
        qf, kf = q.reshape(n, -1), k.reshape(n, -1)
        pos = _flat_positions(wl, inp)
        cache = inp["cache"].float()
        neox = not wl.interleaved
        return Bound(
            lambda: fn(pos, qf, kf, D, cache, is_neox=neox), lambda o: (o[0].view(q.shape), o[1].view(k.shape))
        )

    def note(self, wl):
        return "flashinfer.rope.apply_rope_with_cos_sin_cache"


class VLLM(Peer):
    name = "vllm"
    label = "vLLM CUDA op"

    def available(self, device):
        return _cuda_module_available(device, "vllm._custom_ops")

    def version(self):
        return dist_version("vllm")

    def make(self, wl, inp):
        if wl.kind in W.NORM_KINDS:  # W9 / W10: see norm_make
            return norm_make(self, wl, inp)
        if wl.kind in ("mla", "fwdbwd") or wl.mrope_section is not None:
            raise PeerSkip(
                "n/a",
                {"mla": "needs (T, H*D) q; W6 is a strided slice", "fwdbwd": "no autograd"}.get(
                    wl.kind, "M-RoPE is a separate Triton path"
                ),
            )
        from vllm import _custom_ops as ops

        q, k = inp["q"], inp["k"]
        D = q.shape[-1]
        n = q.shape[:-2].numel()
        qf, kf = q.view(n, -1), k.view(n, -1)
        pos = _flat_positions(wl, inp)
        cache = inp["cache"].to(q.dtype)  # vLLM keeps the table in the activation dtype
        neox = not wl.interleaved
        if wl.kind == "rope":

            def fn():
                ops.rotary_embedding(pos, qf, kf, D, cache, neox)
                return q, k

            return Bound(fn, lambda o: o)
        v, kc, vc, slots = inp["v"], inp["k_cache"], inp["v_cache"], inp["slots"]
        ann = inspect.signature(ops.reshape_and_cache_flash).parameters.get("k_scale")
        float_scale = ann is not None and ann.annotation in (float, "float")
        scale = 1.0 if float_scale else torch.ones((), dtype=torch.float32, device=q.device)

        def fn():
            ops.rotary_embedding(pos, qf, kf, D, cache, neox)
            ops.reshape_and_cache_flash(k, v, kc, vc, slots, "auto", scale, scale)
            return q

        return Bound(fn, lambda o: (q, kc, vc))

    def note(self, wl):
        return (
            "vllm._custom_ops.rotary_embedding"
            + (" + reshape_and_cache_flash" if wl.kind == "store" else "")
            + " (in place)"
        )


class RopekitVLLM(Peer):
    """ropekit.vllm's plugin forward (what its replacement of vLLM's RotaryEmbedding runs), called
    on a module holding vLLM's attributes: (T, H * D) query / key views, in place, the table in
    the activation dtype as vLLM keeps it. vLLM itself is not needed."""

    name = "ropekit-vllm"
    label = "ropekit.vllm plugin forward"
    needs_cuda = False

    def available(self, device):
        return importable("ropekit.integrations.vllm")

    def make(self, wl, inp):
        if wl.kind != "rope" or wl.mrope_section is not None:
            raise PeerSkip("n/a", "the plugin's table forward: plain rotation workloads only")
        forward = importlib.import_module("ropekit.integrations.vllm").FORWARDS["table"]
        q, k = inp["q"], inp["k"]
        n = q.shape[:-2].numel()
        try:
            qf, kf = q.view(n, -1), k.view(n, -1)
        except RuntimeError:
            raise PeerSkip("n/a", "vLLM's (T, H * D) query: this layout is not one") from None
        pos = _flat_positions(wl, inp)
        module = torch.nn.Module()  # vLLM's RotaryEmbedding attributes
        module.head_size, module.rotary_dim = q.shape[-1], inp["cache"].shape[-1]
        module.is_neox_style, module.cos_sin_cache = not wl.interleaved, inp["cache"].to(q.dtype)

        def fn():
            forward(module, pos, qf, kf)
            return q, k

        return Bound(fn, lambda o: o)

    def note(self, wl):
        return "ropekit.vllm.FORWARDS['table'] (in place)"


class FlashAttn(Peer):
    name = "flash-attn"
    label = "flash-attn Triton rotary"

    def available(self, device):
        return _cuda_module_available(device, "flash_attn.layers.rotary")

    def version(self):
        return dist_version("flash-attn", "flash_attn")

    def make(self, wl, inp):
        if wl.kind in W.NORM_KINDS:  # W9 / W10: see norm_make
            return norm_make(self, wl, inp)
        if wl.kind == "store" or wl.mrope_section is not None:
            raise PeerSkip("n/a", "no KV-cache store" if wl.kind == "store" else "no M-RoPE")
        from flash_attn.layers.rotary import apply_rotary_emb as rot

        dt = inp["q"].dtype
        cos, sin = _half_table(inp, dt)  # flash-attn wants cos/sin in x's dtype
        il = wl.interleaved
        if wl.kind == "mla":
            R = inp["k_pe"].shape[-1]
            xq, xk = inp["q"][..., -R:].unsqueeze(0), inp["k_pe"].unsqueeze(0)  # (1, T, H, 64)
            return Bound(
                lambda: (
                    rot(xq, cos, sin, interleaved=il, inplace=True),
                    rot(xk, cos, sin, interleaved=il, inplace=True),
                ),
                lambda o: (inp["q"], inp["k_pe"]),
            )
        if wl.kind == "fwdbwd":
            q, k = inp["q"].requires_grad_(), inp["k"].requires_grad_()
            fwd = lambda q_, k_: (rot(q_, cos, sin, interleaved=il), rot(k_, cos, sin, interleaved=il))  # noqa: E731
            return Bound(_grad_fn(fwd, q, k, inp["gq"], inp["gk"]), lambda o: tuple(o))
        q, k = inp["q"], inp["k"]
        if wl.layout == "bshd":
            return Bound(
                lambda: (rot(q, cos, sin, interleaved=il), rot(k, cos, sin, interleaved=il)), lambda o: tuple(o)
            )
        if wl.layout == "decode":  # T sequences of one token at their positions
            off = inp["positions"].to(torch.int32)
            xq, xk = q.unsqueeze(1), k.unsqueeze(1)
            return Bound(
                lambda: (
                    rot(xq, cos, sin, interleaved=il, seqlen_offsets=off),
                    rot(xk, cos, sin, interleaved=il, seqlen_offsets=off),
                ),
                lambda o: (o[0].squeeze(1), o[1].squeeze(1)),
            )
        xq, xk = q.unsqueeze(0), k.unsqueeze(0)  # prefill from position 0
        return Bound(
            lambda: (rot(xq, cos, sin, interleaved=il), rot(xk, cos, sin, interleaved=il)),
            lambda o: (o[0].squeeze(0), o[1].squeeze(0)),
        )

    def note(self, wl):
        return "flash_attn.layers.rotary.apply_rotary_emb (one call each for q and k)"


# ------------------------------------------------------------------------------------------
# W12 (re-rotation of cached keys): one self-contained section. ropekit and the torch peers get a
# `rerotate` branch in front of their make(); every other peer has no such op (n/a).


def torch_rerotate(k_cache, slots, delta, table, interleaved: bool, k_scale: Optional[float], positions=None, to=None):
    """The plain-torch way: gather the rows, rotate them by the angle of delta (negative: inverse),
    scatter them back. k_cache (num_blocks, block, H, D), any float dtype or fp8 with k_scale. With
    positions and a second table `to`: the rotation from table row positions to `to` row positions +
    delta, composed as (c_t + i s_t) / (c_f + i s_f)."""
    rows = k_cache.flatten(0, 1)
    x = rows[slots].float()
    if k_scale is not None:
        x = x * k_scale
    half = table.shape[-1] // 2
    if to is None:
        ang = table[delta.abs()]
        cos, sin = ang[:, None, :half], ang[:, None, half:] * delta.sign()[:, None, None]
    else:
        f, t = table[positions][:, None], to[positions + delta][:, None]
        cf, sf, ct, st = f[..., :half], f[..., half:], t[..., :half], t[..., half:]
        norm = cf * cf + sf * sf
        cos, sin = (ct * cf + st * sf) / norm, (st * cf - ct * sf) / norm
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    else:
        x1, x2 = x[..., :half], x[..., half:]
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    if k_scale is not None:
        out = out / k_scale
    rows[slots] = out.to(rows.dtype)
    return k_cache


def _rerotate_args(inp, wl):
    cache = inp["k_cache"]
    view = W.rerotate_view(wl, cache)
    scale = W.W12_K_SCALE if cache.dtype == torch.float8_e4m3fn else None
    return cache, view, inp["slots"], inp["delta"], inp["cache"], scale


def _two_tables(inp) -> dict:
    """W12-2T's extra arguments (stored positions, the table rows move to); {} for the other rows."""
    return {"positions": inp["positions"], "to_cache": inp["to_cache"]} if "to_cache" in inp else {}


def _ropekit_rerotate(self, wl, inp):
    op = self._op("rerotate_kv_cache")
    cache, view, slots, delta, table, scale = _rerotate_args(inp, wl)
    ks = None if scale is None else torch.tensor([scale], device=cache.device)
    two = _two_tables(inp)
    return Bound(
        lambda: op(view, slots, delta, table, interleaved=wl.interleaved, k_scale=ks, **two), lambda o: (cache,)
    )


def _torch_rerotate(self, wl, inp):
    cache, view, slots, delta, table, scale = _rerotate_args(inp, wl)
    fn = self.wrap(wl, "rerotate", torch_rerotate)
    self._notes[wl.id] = "gather, rotate, scatter (plain torch)"
    two = _two_tables(inp)
    pos, to = two.get("positions"), two.get("to_cache")
    return Bound(lambda: fn(view, slots, delta, table, wl.interleaved, scale, pos, to), lambda o: (cache,))


def _with_rerotate(cls, handler, note=None):
    """cls.make, with workloads of kind "rerotate" sent to handler (None: the peer has no such op)."""
    make, note_of = cls.make, cls.note

    def make_(self, wl, inp):
        if wl.kind != "rerotate":
            return make(self, wl, inp)
        if handler is None:
            raise PeerSkip("n/a", "no re-rotation of cached keys")
        return handler(self, wl, inp)

    def note_(self, wl):
        if wl.kind == "rerotate" and note is not None:
            return note(self)
        return note_of(self, wl)

    cls.make, cls.note = make_, note_


_with_rerotate(Ropekit, _ropekit_rerotate, lambda self: f"{self.module}.rerotate_kv_cache (in place)")  # Reference too
_with_rerotate(TorchEager, _torch_rerotate)  # TorchCompile too: its wrap() compiles
for _cls in (RopekitUnfused, RopekitHF, Liger, FlashInfer, VLLM, FlashAttn):
    _with_rerotate(_cls, None)


def forms_only_ropekit(peer: Peer, wl: W.Workload) -> None:
    """The store's serving forms (W7-WK, W10-FP8Q, W7-KNOPE, e5m2 caches) and apply_rope's
    conventions (W1-SBHD, W1-HEADTABLE, W1-QTEMP, W2-OUT, W2-STRIDED, W2-EAGER, W6-LAST) are ropekit's keywords: other peers are n/a
    there (their plain rows are beside them)."""
    if (wl.store_forms or wl.cache_dtype == "e5m2") and peer.name != "ropekit":
        raise PeerSkip("n/a", "a ropekit store form (see the plain store row for this peer)")
    if wl.rope_forms and peer.name != "ropekit":
        raise PeerSkip("n/a", "a ropekit apply_rope convention (see the plain row for this peer)")


def all_peers() -> List[Peer]:
    return [
        Ropekit(),
        RopekitUnfused(),
        RopekitHF(),
        Reference(),
        TorchEager(),
        TorchCompile(),
        Liger(),
        FlashInfer(),
        VLLM(),
        RopekitVLLM(),
        FlashAttn(),
        RopekitCuSeqlens(),
        TorchCompileGather(),
    ]


NAMES = [p.name for p in all_peers()]


# ------------------------------------------------------------------------------------------
# W9 / W10: q/k RMSNorm + RoPE (+ paged store). One function for every peer, by name: the HF code
# (the family's RMSNorm on the (B, S, H, D) view, then apply_rotary_pos_emb), torch.compile of it,
# Liger (LigerRMSNorm + liger_rotary_pos_emb), ropekit unfused (torch's rms_norm, then ropekit),
# ropekit fused (one call).


def _hf_rmsnorm(weight, eps):
    """Qwen3's RMSNorm module holding `weight` (transformers' class when importable)."""
    try:
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

        mod = Qwen3RMSNorm(weight.shape[0], eps=eps)
        note = "transformers Qwen3RMSNorm"
    except Exception:

        class _Norm(torch.nn.Module):
            def __init__(self, n, eps):
                super().__init__()
                self.weight = torch.nn.Parameter(torch.ones(n))
                self.variance_epsilon = eps

            def forward(self, x):
                h = x.float()
                h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
                return self.weight * h.to(x.dtype)

        mod, note = _Norm(weight.shape[0], eps), "bench's plain-torch Qwen3 RMSNorm"
    mod = mod.to(device=weight.device, dtype=weight.dtype)
    mod.weight = torch.nn.Parameter(weight, requires_grad=weight.requires_grad)
    return mod, note


def _liger_rmsnorm(weight, eps):
    from liger_kernel.transformers.rms_norm import LigerRMSNorm

    mod = LigerRMSNorm(weight.shape[0], eps=eps).to(device=weight.device, dtype=weight.dtype)
    mod.weight = torch.nn.Parameter(weight, requires_grad=weight.requires_grad)
    return mod, "liger_kernel LigerRMSNorm"


def _norm_grad_fn(forward, q, k, wq, wk, gq, gk):
    def fn():
        qo, ko = forward(q, k)
        dq, dk, dwq, dwk = torch.autograd.grad((qo, ko), (q, k, wq, wk), (gq, gk))
        return qo, ko, dq, dk, dwq, dwk

    return fn


_NORM_NOTES: Dict[Tuple[str, str], str] = {}


def norm_make(peer: Peer, wl: W.Workload, inp: Dict[str, torch.Tensor]) -> Bound:
    """The Bound of `peer` on a q/k-norm workload (PeerSkip for peers without the op)."""
    name, eps = peer.name, W.NORM_EPS
    pos, cache = inp.get("positions"), inp["cache"]
    grad = wl.kind == "normfwdbwd"
    if grad:
        for n in ("q", "k", "wq", "wk"):
            inp[n].requires_grad_(True)
    q, k, wq, wk = inp["q"], inp["k"], inp["wq"], inp["wk"]
    store = wl.kind == "normstore"
    if store:
        kc, vc, v, slots = inp["k_cache"], inp["v_cache"], inp["v"], inp["slots"]
        k_rows, v_rows = kc.view(-1, *kc.shape[2:]), vc.view(-1, *vc.shape[2:])

    def finish(forward_tokens, note, weights=(wq, wk)):
        """forward_tokens(q, k) -> (q_out, k_out) in token layout; builds the workload's Bound.
        weights: the leaves the weight gradients are taken for (a peer's module parameters)."""
        _NORM_NOTES[(name, wl.id)] = note
        if isinstance(getattr(peer, "_notes", None), dict):
            peer._notes[wl.id] = note
        if grad:
            return Bound(_norm_grad_fn(forward_tokens, q, k, *weights, inp["gq"], inp["gk"]), tuple)
        if store:

            def put(rows, x):
                if rows.dtype == torch.float8_e4m3fn:  # no fp8 index_copy: move the bytes
                    rows.view(torch.uint8).index_copy_(0, slots, x.float().to(rows.dtype).view(torch.uint8))
                else:
                    rows.index_copy_(0, slots, x.to(rows.dtype))

            def fn():
                qo, ko = forward_tokens(q, k)
                put(k_rows, ko)
                put(v_rows, v)
                return qo

            return Bound(fn, lambda o: (o, kc, vc))
        return Bound(lambda: forward_tokens(q, k), tuple)

    if name == "ropekit":
        import ropekit

        if store:
            _NORM_NOTES[(name, wl.id)] = "ropekit.apply_rope_and_store(q_norm_weight=, k_norm_weight=) (one launch)"
            if "q_out" in inp:
                q_out = inp["q_out"]
                _NORM_NOTES[(name, wl.id)] = "ropekit.apply_rope_and_store(q_norm_weight=, k_norm_weight=, q_out=fp8)"
                return Bound(
                    lambda: ropekit.apply_rope_and_store(
                        q,
                        k,
                        v,
                        pos,
                        cache,
                        kc,
                        vc,
                        slots,
                        q_norm_weight=wq,
                        k_norm_weight=wk,
                        norm_eps=eps,
                        q_out=q_out,
                        q_scale=W.Q_SCALE,
                    ),
                    lambda o: (q_out, kc, vc),
                )
            return Bound(
                lambda: ropekit.apply_rope_and_store(
                    q, k, v, pos, cache, kc, vc, slots, q_norm_weight=wq, k_norm_weight=wk, norm_eps=eps
                ),
                lambda o: (q, kc, vc),
            )
        if wl.norm == "l2":
            return finish(
                lambda q_, k_: ropekit.apply_rope(q_, k_, pos, cache, l2_norm=True, norm_eps=eps),
                "ropekit.apply_rope(l2_norm=True) (one launch)",
            )
        return finish(
            lambda q_, k_: ropekit.apply_rope(q_, k_, pos, cache, q_norm_weight=wq, k_norm_weight=wk, norm_eps=eps),
            "ropekit.apply_rope(q_norm_weight=, k_norm_weight=) (one launch)",
        )
    if name == "ropekit-unfused":
        import ropekit

        F = torch.nn.functional
        rms = lambda x, w: F.rms_norm(x, (x.shape[-1],), w, eps)  # noqa: E731
        if store:
            # fp8: normalized q/k kept in float32 (a bf16 intermediate would round twice before fp8)
            up = kc.dtype == torch.float8_e4m3fn
            note = "torch rms_norm, then ropekit.apply_rope_and_store (plain fused store)"
            peer_note = note + (" (float32 intermediates)" if up else "")
            _NORM_NOTES[(name, wl.id)] = peer_note

            def fn():
                qn = rms(q.float(), wq.float()) if up else rms(q, wq)
                kn = rms(k.float(), wk.float()) if up else rms(k, wk)
                ropekit.apply_rope_and_store(qn, kn, v.float() if up else v, pos, cache, kc, vc, slots)
                return qn

            return Bound(fn, lambda o: (o, kc, vc))
        return finish(
            lambda q_, k_: ropekit.apply_rope(rms(q_, wq), rms(k_, wk), pos, cache),
            "torch.nn.functional.rms_norm, then ropekit.apply_rope",
        )
    if name in ("torch-eager", "torch-compile", "liger"):
        F_ = peer.fns(("apply",)) if name != "liger" else None
        if name == "liger":
            from liger_kernel.transformers.rope import liger_rotary_pos_emb as apply

            qn_mod, nnote = _liger_rmsnorm(wq, eps)
            kn_mod, _ = _liger_rmsnorm(wk, eps)
            anote = "liger_rotary_pos_emb"
        else:
            apply, anote = F_["apply"]
            qn_mod, nnote = _hf_rmsnorm(wq, eps)
            kn_mod, _ = _hf_rmsnorm(wk, eps)
        cos, sin = hf_cos_sin(wl, inp, q.dtype)

        def hf_forward(q_, k_):
            # the HF attention's order: norm on the (B, S, H, D) view, transpose, rotate
            qh, kh = W.to_hf(wl, qn_mod(q_)), W.to_hf(wl, kn_mod(k_))
            qo, ko = apply(qh, kh, cos, sin)
            return W.from_hf(wl, qo), W.from_hf(wl, ko)

        fwd = peer.wrap(wl, "qknorm", hf_forward) if name == "torch-compile" else hf_forward
        return finish(
            fwd,
            f"{nnote}, then {anote}" + (" (torch.compile)" if name == "torch-compile" else ""),
            (qn_mod.weight, kn_mod.weight),
        )
    raise PeerSkip("n/a", "no fused q/k RMSNorm + RoPE workload for this peer")


# ------------------------------------------------------------------------------------------
# W13-W15 (axial RoPE of image / video transformers): ropekit computes the angles in the kernel from
# positions x frequencies (the norm fused); torch eager runs diffusers' code on the cos / sin its
# position embedding computed (torch's RMSNorm, then apply_rotary_emb), torch.compile compiles
# that; every other peer has no such op (n/a).


def diffusers_prologue(q, k, cos, sin, wq, wk, eps: float):
    """diffusers' attention prologue: RMSNorm of q and k (per head, or across heads on the
    (B, S, H * D) view as Wan does), then apply_rotary_emb on each."""
    outs = []
    for x, w in ((q, wq), (k, wk)):
        if w is not None:
            shape = x.shape if w.shape[0] == x.shape[-1] else (*x.shape[:-2], w.shape[0])
            x = torch.nn.functional.rms_norm(x.reshape(shape), (w.shape[0],), w, eps).view(x.shape)
        outs.append(W.diffusers_rotate(x, cos, sin))
    return tuple(outs)


def _axial_grad_fn(forward, leaves, gq, gk):
    def fn():
        qo, ko = forward(*leaves)
        return (qo, ko, *torch.autograd.grad((qo, ko), leaves, (gq, gk)))

    return fn


def _axial_bound(wl, inp, forward):
    """Bound of an axial workload: forward(q, k, wq, wk) -> (q_out, k_out); fb: through autograd."""
    q, k, wq, wk = inp["q"], inp["k"], inp.get("wq"), inp.get("wk")
    ident = lambda o: tuple(o)  # noqa: E731
    if wl.kind == "axial":
        return Bound(lambda: forward(q, k, wq, wk), ident)
    leaves = [x.requires_grad_() for x in (q, k, wq, wk) if x is not None]
    fwd = (
        (lambda q_, k_, wq_, wk_: forward(q_, k_, wq_, wk_))
        if wq is not None
        else (lambda q_, k_: forward(q_, k_, None, None))
    )
    return Bound(_axial_grad_fn(fwd, leaves, inp["gq"], inp["gk"]), ident)


def _ropekit_axial(self, wl, inp):
    op = self._op("apply_rope")
    pos, freqs, axes = inp["positions"], inp["cache"], tuple(d // 2 for d in wl.axes_dim)

    def forward(q, k, wq, wk):
        return op(q, k, pos, None, inv_freq=freqs, axes=axes, interleaved=True, q_norm_weight=wq, k_norm_weight=wk)

    return _axial_bound(wl, inp, forward)


def _reference_axial(self, wl, inp):
    """The PyTorch reference on an axial workload, from its own functions: angles_from_freqs, then
    rms_norm (unrounded) and rotate, rounded once to the input dtype."""
    ref = self._mod()
    pos, freqs, axes = inp["positions"], inp["cache"], tuple(d // 2 for d in wl.axes_dim)

    def forward(q, k, wq, wk):
        cos, sin = ref.angles_from_freqs(pos, freqs, axes)
        return tuple(
            ref.rotate(x if w is None else ref.rms_norm(x, w, eps=W.NORM_EPS), cos, sin, interleaved=True).to(x.dtype)
            for x, w in ((q, wq), (k, wk))
        )

    return _axial_bound(wl, inp, forward)


def _torch_axial(self, wl, inp):
    fn = self.wrap(wl, "axial", diffusers_prologue)
    self._notes[wl.id] = "diffusers' code: torch RMSNorm, then apply_rotary_emb (use_real, pairs)"
    cos, sin = inp["cos"], inp["sin"]
    return _axial_bound(wl, inp, lambda q, k, wq, wk: fn(q, k, cos, sin, wq, wk, W.NORM_EPS))


def _with_axial(cls, handler, note=None):
    """cls.make, with axial workloads sent to handler (None: the peer has no such op)."""
    make, note_of = cls.make, cls.note

    def make_(self, wl, inp):
        if wl.kind not in W.AXIAL_KINDS:
            return make(self, wl, inp)
        if handler is None:
            raise PeerSkip("n/a", "no axial RoPE from positions x frequencies")
        return handler(self, wl, inp)

    def note_(self, wl):
        if wl.kind in W.AXIAL_KINDS and note is not None:
            return note(self)
        return note_of(self, wl)

    cls.make, cls.note = make_, note_


_with_axial(Ropekit, _ropekit_axial, lambda self: f"{self.module}.apply_rope(inv_freq=, axes=, norm weights)")
_with_axial(Reference, _reference_axial, lambda self: f"{self.module}: angles_from_freqs, rms_norm, rotate")
_with_axial(TorchEager, _torch_axial)  # TorchCompile too: its wrap() compiles
for _cls in (RopekitUnfused, RopekitHF, Liger, FlashInfer, VLLM, FlashAttn, RopekitCuSeqlens, TorchCompileGather):
    _with_axial(_cls, None)
