"""The benchmark workloads W1..W8 of WORKLOADS.md.

Each workload says what it computes (shapes, layout, flags), makes its inputs, counts the minimal
bytes that must move through memory (the floor), and computes the float64 outputs every
implementation is checked against before it is timed.

Inputs are a dict of *base* tensors, all contiguous, so that a fresh copy for a correctness check
is a plain clone; the views an implementation needs (HF's (B, H, S, D) view of a (B, S, H, D)
buffer, W6's strided 64-wide slice of a 192-wide head) are rebuilt from the bases.

Canonical outputs, what every implementation's adapter hands back for checking:
    rope   (q_out, k_out) in token layout: (B, S, H, D) or (T, H, D)
    mla    (q, k_pe) after the in-place rotation: the whole (T, 128, 192) q, so a write outside
           the rotated slice is caught
    store  (q, k_cache, v_cache) after the call (q rotated in place, cache rows written)
    fwdbwd (q_out, k_out, dq, dk) in token layout
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..reference import nvfp4_dequantize, nvfp4_quantize, nvfp4_unpack

DTYPE = torch.bfloat16


@dataclass(frozen=True)
class Workload:
    id: str  # "W1", "W7-T64"
    name: str  # "train_8b"
    kind: str  # "rope" | "mla" | "store" | "fwdbwd" | "rerotate"
    what: str  # one line for tables
    full: Dict[str, int]  # sizes as in WORKLOADS.md
    quick: Dict[str, int]  # small sizes (--quick, and every CPU run)
    layout: str = "flat"  # "bshd": two token dims, HF passes (B, H, S, D) views;
    #                            "flat": (T, H, D) prefill; "decode": (T, H, D), one token per sequence
    positions: str = "arange"  # "none" (None: arange over S), "arange", "random", "mrope"
    interleaved: bool = False
    mrope_section: Optional[Tuple[int, ...]] = None  # positions (len(mrope_section), T)
    mrope_layout: Optional[str] = None  # apply_rope's mrope_layout (None: chunked); "ernie" has a local oracle
    base: float = 500000.0  # rope theta used to build the table
    graph: bool = False  # launch-bound: time with CUDA-graph replay
    host: bool = False  # also report host (wall-clock) time per eager call
    packed: Optional[Tuple[int, int]] = None  # W11: (sequences, cp_size): THD tokens with cu_seqlens
    cache_dtype: str = ""  # store workloads: "" (the activation dtype), "fp8" (float8_e4m3fn) or "e5m2"
    # store workloads: apply_rope_and_store's serving forms, "write_key" (rotated k written back
    # into k), "fp8_q_out" (q rotated into a separate e4m3 q_out, scale Q_SCALE), "k_nope" (k given
    # as its rope part and its no-rope part k_nope beside v: sizes' R is the rope width) and
    # "q_nope" (q likewise, its no-rope part into q_out after rotated q) and "nvfp4" (NVFP4 caches:
    # uint8 codes (..., D / 2), e4m3 block scales (..., D / 16), global scales NVFP4_GLOBAL)
    store_forms: Tuple[str, ...] = ()
    # rope / mla workloads: apply_rope's conventions on the plain row's inputs, "sbhd" (q and k
    # contiguous (S, B, H, D), layout='sbhd'), "out" (destinations q_out= / k_out=), "last" (MLA's
    # whole (T, H, nope + rope) q with rotary_position='last', in place), "strided" (q and k
    # with last stride 2: read by the kernel through the stride), "head_table" (a per-KV-head table
    # (P, Hk, R), FoPE's form, with explicit positions), "eager" (eager_rounding=True) and
    # "q_temperature" (Llama 4's attention temperature tuning of q, Q_TEMPERATURE, explicit positions)
    rope_forms: Tuple[str, ...] = ()
    # graph workloads: 0 walks input sets larger than L2 together, one call each; N > 0 captures N
    # calls on ONE input set in the graph (its data stays in L2: the launch-bound floor of a row)
    one_set_calls: int = 0
    # axial workloads (W13-W15): rotary dims per axis, and the QK norm ("" none, "head", "heads");
    # W9-L2: "l2", the norm without a weight (apply_rope's l2_norm)
    axes_dim: Tuple[int, ...] = ()
    norm: str = ""

    @property
    def group(self) -> str:
        """'W7' for 'W7-T64': --workloads W7 selects both."""
        return self.id.split("-")[0]

    def sizes(self, quick: bool) -> Dict[str, int]:
        return dict(self.quick if quick else self.full)


def _llama8b(**kw):
    return dict(Hq=32, Hk=8, D=128, **kw)


def _qwen3_normed(name: str, key: str, kind: str, what: str, **kw) -> "Workload":
    """A W9-family row: Qwen3-8B's normed rotation at W1's training-step shapes, HF layout."""
    full, quick = _llama8b(B=4, S=4096, P=8192), _llama8b(B=2, S=128, P=8192)
    return Workload(name, key, kind, what, full=full, quick=quick, layout="bshd", positions="none", base=1e6, **kw)


_W1 = Workload(
    "W1",
    "train_8b",
    "rope",
    "Llama-3-8B training step, HF layout (q/k are (B,H,S,D) views of (B,S,H,D))",
    full=_llama8b(B=4, S=4096, P=8192),
    quick=_llama8b(B=2, S=128, P=8192),
    layout="bshd",
    positions="none",
)
_W4 = Workload(
    "W4",
    "mrope",
    "rope",
    "Qwen2-VL-7B M-RoPE, sections (16, 24, 24), 3-D positions",
    full=dict(T=16384, Hq=28, Hk=4, D=128, P=32768),
    quick=dict(T=256, Hq=28, Hk=4, D=128, P=32768),
    positions="mrope",
    mrope_section=(16, 24, 24),
    base=1000000.0,
)
_W3 = Workload(
    "W3",
    "decode_b64",
    "rope",
    "decode, 64 sequences, random positions in [0, 65536)",
    full=_llama8b(T=64, P=65536),
    quick=_llama8b(T=64, P=65536),
    layout="decode",
    positions="random",
    graph=True,
    host=True,
)

WORKLOADS: List[Workload] = [
    _W1,
    Workload(
        "W2",
        "prefill_70b",
        "rope",
        "Llama-3-70B prefill, positions 0..T-1",
        full=dict(T=32768, Hq=64, Hk=8, D=128, P=32768),
        quick=dict(T=256, Hq=64, Hk=8, D=128, P=32768),
    ),
    _W3,
    replace(
        _W3,
        id="W3-1",
        name="decode_b64_one_set",
        what="W3 with one input set: 100 calls per CUDA graph on the same inputs (the data stays in L2)",
        host=False,
        one_set_calls=100,
    ),
    _W4,
    replace(
        _W4,
        id="W4-N4",
        name="mrope_n4_ernie",
        what="W4 with 4 position rows, sections (16, 16, 16, 16) in ERNIE 4.5-VL's layout "
        "(rows 1-3 cycling over 48 pairs, row 0 the last 16): the axis-map kernel path",
        mrope_section=(16, 16, 16, 16),
        mrope_layout="ernie",
    ),
    Workload(
        "W5",
        "llama4",
        "rope",
        "Llama-4 interleaved (complex) RoPE",
        full=dict(T=16384, Hq=40, Hk=8, D=128, P=16384),
        quick=dict(T=256, Hq=40, Hk=8, D=128, P=16384),
        interleaved=True,
    ),
    Workload(
        "W6",
        "mla",
        "mla",
        "DeepSeek-V3 MLA: rotate q[..., 128:] of (T,128,192) in place, k_pe (T,1,64), interleaved",
        full=dict(T=16384, H=128, Dq=192, R=64, P=16384),
        quick=dict(T=256, H=128, Dq=192, R=64, P=16384),
        interleaved=True,
        base=10000.0,
    ),
    Workload(
        "W7",
        "store",
        "store",
        "fused RoPE + paged KV-cache store, Llama-3-8B heads, block 16, shuffled slots",
        full=_llama8b(T=16384, P=65536, block=16),
        quick=_llama8b(T=256, P=65536, block=16),
    ),
    Workload(
        "W7-T64",
        "store_t64",
        "store",
        "W7 at T=64 (decode step), random positions",
        full=_llama8b(T=64, P=65536, block=16),
        quick=_llama8b(T=64, P=65536, block=16),
        positions="random",
        graph=True,
        host=True,
    ),
    replace(_W1, id="W8", name="train_8b_fwd_bwd", kind="fwdbwd", what="W1 through autograd, forward then backward"),
    # W8's eager row carries autograd's host work (an empty Function's forward + backward is 100-160
    # us on the H200 host, about the two kernels' time): the kernels' own figure is this row's
    replace(
        _W1,
        id="W8-G",
        name="train_8b_fwd_bwd_graph",
        kind="fwdbwd",
        graph=True,
        what="W8 under CUDA-graph replay (forward and backward captured)",
    ),
    # W11: THD packing; positions="packed" gives inputs cu_seqlens (this rank's local lengths) and
    # the same tokens' explicit positions (the `ropekit` peer times those, `ropekit-cu` the cu_seqlens path)
    Workload(
        "W11",
        "packed_2401",
        "rope",
        "THD packing: 65,536 tokens as 2,401 sequences, Llama-3-8B heads",
        full=_llama8b(T=65536, N=2401, P=131072),
        quick=_llama8b(T=512, N=19, P=131072),
        positions="packed",
        packed=(2401, 1),
    ),
    # q/k RMSNorm + RoPE (Qwen3-8B: 32 q heads, 8 kv heads of 128, per-head norm weights (128,))
    _qwen3_normed(
        "W9", "qknorm_8b", "normrope", "Qwen3-8B per-head q/k RMSNorm + RoPE, HF layout (training step shapes of W1)"
    ),
    _qwen3_normed(
        "W9-L2",
        "l2norm_8b",
        "normrope",
        "W9 with Llama 4's unweighted q/k norm (ropekit: l2_norm=True; peers: their norm with unit weights)",
        norm="l2",
    ),
    _qwen3_normed(
        "W9-FB",
        "qknorm_8b_fwd_bwd",
        "normfwdbwd",
        "W9 through autograd, forward then backward (gradients of q, k and both norm weights)",
    ),
    Workload(
        "W10",
        "qknorm_store",
        "normstore",
        "W9's norm + RoPE + paged KV store (bf16 cache), block 16",
        full=_llama8b(T=16384, P=65536, block=16),
        quick=_llama8b(T=256, P=65536, block=16),
        base=1000000.0,
    ),
    Workload(
        "W10-FP8",
        "qknorm_store_fp8",
        "normstore",
        "W10 into an fp8 (e4m3) cache, k_scale 1",
        full=_llama8b(T=16384, P=65536, block=16),
        quick=_llama8b(T=256, P=65536, block=16),
        base=1000000.0,
        cache_dtype="fp8",
    ),
    Workload(
        "W10-T64",
        "qknorm_store_t64",
        "normstore",
        "W10 at T=64 (decode step), random positions",
        full=_llama8b(T=64, P=65536, block=16),
        quick=_llama8b(T=64, P=65536, block=16),
        positions="random",
        graph=True,
        host=True,
        base=1000000.0,
    ),
    Workload(
        "W10-T64-FP8",
        "qknorm_store_t64_fp8",
        "normstore",
        "W10-T64 into an fp8 (e4m3) cache",
        full=_llama8b(T=64, P=65536, block=16),
        quick=_llama8b(T=64, P=65536, block=16),
        positions="random",
        graph=True,
        host=True,
        base=1000000.0,
        cache_dtype="fp8",
    ),
]

# the store's serving forms beside the plain store rows (same sizes, inputs and slots per seed)
# W11's other packings, right after it
_W11 = next(w for w in WORKLOADS if w.id == "W11")
WORKLOADS[WORKLOADS.index(_W11) + 1 : WORKLOADS.index(_W11) + 1] = [
    replace(
        _W11,
        id="W11-N64",
        name="packed_64",
        what="W11 as 64 sequences",
        full=_llama8b(T=65536, N=64, P=131072),
        quick=_llama8b(T=512, N=4, P=131072),
        packed=(64, 1),
    ),
    replace(
        _W11,
        id="W11-CP2",
        name="packed_2401_cp2",
        what="W11 on context-parallel rank 0 of 2 (dual-chunk positions of sequences twice as long)",
        packed=(2401, 2),
    ),
]
_W7, _W7_T64, _W10, _W10_T64 = (next(w for w in WORKLOADS if w.id == i) for i in ("W7", "W7-T64", "W10", "W10-T64"))
_FORMS = [
    replace(
        _W7,
        id="W7-WK",
        name="store_write_key",
        what="W7, rotated k also written back into k",
        store_forms=("write_key",),
    ),
    replace(
        _W7,
        id="W7-WK-E5M2",
        name="store_write_key_e5m2",
        what="W7-WK into an fp8 e5m2 cache, k_scale 1",
        store_forms=("write_key",),
        cache_dtype="e5m2",
    ),
    replace(
        _W7,
        id="W7-NVFP4",
        name="store_nvfp4",
        what="W7 into NVFP4 caches: e2m1 codes two a byte + an e4m3 scale per 16 values, global scales 0.25",
        store_forms=("nvfp4",),
    ),
    replace(
        _W7_T64, id="W7-T64-WK", name="store_t64_write_key", what="W7-T64, k written back", store_forms=("write_key",)
    ),
    replace(
        _W10,
        id="W10-FP8Q",
        name="qknorm_store_fp8_q",
        what="W10 with q out to an fp8 (e4m3) tensor, q_scale 0.5 (an FP8 attention's input)",
        store_forms=("fp8_q_out",),
    ),
    replace(
        _W10_T64,
        id="W10-T64-FP8Q",
        name="qknorm_store_t64_fp8_q",
        what="W10-T64 with q out to fp8 (e4m3)",
        store_forms=("fp8_q_out",),
    ),
]
_W2, _W6 = (next(w for w in WORKLOADS if w.id == i) for i in ("W2", "W6"))
_W7_R64 = replace(_W7, full=dict(_W7.full, R=64), quick=dict(_W7.quick, R=64))  # the heads' rope part: 64 of 128
_FORMS += [
    replace(
        _W7_R64,
        id="W7-KNOPE",
        name="store_k_nope",
        what="W7 with each k head as FlashInfer's parts: rope 64 (k) + no-rope 64 (k_nope) beside v; "
        "q rotated in place on its first 64 dims",
        store_forms=("k_nope",),
    ),
    replace(
        _W7_R64,
        id="W7-QNOPE",
        name="store_q_nope_fp8_q",
        what="W7-KNOPE with q as rope 64 + q_nope 64 into an e4m3 q_out [rotated | q_nope], q_scale 0.5 "
        "(FlashInfer's rope_quantize_fp8_append_paged_kv_cache, GQA)",
        store_forms=("k_nope", "q_nope", "fp8_q_out"),
    ),
    replace(
        _W1,
        id="W1-SBHD",
        name="train_8b_sbhd",
        what="W1's q and k contiguous (S, B, H, D), layout='sbhd' (Transformer Engine's)",
        rope_forms=("sbhd",),
    ),
    replace(
        _W1,
        id="W1-HEADTABLE",
        name="train_8b_head_table",
        what="W1 with a per-head table (P, Hk, D), a row per (position, KV head) (FoPE's form): q's heads "
        "in groups of Hq / Hk read their KV head's rows; explicit (B, S) positions",
        rope_forms=("head_table",),
    ),
    replace(
        _W1,
        id="W1-QTEMP",
        name="train_8b_q_temperature",
        what="W1 with Llama 4's attention temperature tuning of q (q_temperature=Q_TEMPERATURE: q times "
        "log(floor((p + 1) / 32) + 1) * 0.1 + 1); explicit (B, S) positions",
        rope_forms=("q_temperature",),
    ),
    replace(_W2, id="W2-OUT", name="prefill_70b_out", what="W2 into given q_out= / k_out=", rope_forms=("out",)),
    replace(
        _W2,
        id="W2-STRIDED",
        name="prefill_70b_strided",
        what="W2 with q and k of last stride 2 (every other element of a buffer): read through the stride",
        rope_forms=("strided",),
    ),
    replace(
        _W2,
        id="W2-EAGER",
        name="prefill_70b_eager",
        what="W2 with eager_rounding=True (the rotation rounded as eager PyTorch's, in bf16)",
        rope_forms=("eager",),
    ),
    replace(
        _W6,
        id="W6-LAST",
        name="mla_rope_last",
        what="W6 on the whole (T, 128, 192) q: rotary_dim 64, rotary_position='last', in place",
        rope_forms=("last",),
    ),
]
for _w in _FORMS:  # each beside its plain store rows (the table keeps this order)
    WORKLOADS.insert(max(i for i, w in enumerate(WORKLOADS) if w.group == _w.group) + 1, _w)
Q_SCALE = 0.5  # fp8_q_out: q_out holds rotated q / Q_SCALE
# q_temperature: (floor_scale, attn_scale); a floor scale far below the rows' sequence lengths, so
# q's factor takes many values along a sequence, at --quick's 128 tokens too (Llama 4's own 8192
# would leave it 1 there, and the correctness check blind to the scaling)
Q_TEMPERATURE = (32.0, 0.1)
FP8_OF = {"fp8": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
NVFP4_GLOBAL = 0.25  # nvfp4: k_scale = v_scale, the per-tensor global scales (a power of two)

# the q/k-norm workloads (W9, W10): norm weights in the inputs, their own oracle and byte counts
NORM_KINDS = ("normrope", "normfwdbwd", "normstore")
NORM_EPS = 1e-6

BY_ID = {w.id: w for w in WORKLOADS}


def select(spec: Optional[str]) -> List[Workload]:
    """'W1,W3' -> those workloads; a group id (W7) selects its variants; names work too."""
    if not spec or spec.strip().lower() == "all":
        return list(WORKLOADS)
    chosen: List[Workload] = []
    for tok in (t.strip() for t in spec.split(",")):
        if not tok:
            continue
        hits = [w for w in WORKLOADS if tok.upper() in (w.id.upper(), w.group.upper()) or tok.lower() == w.name.lower()]
        if not hits:
            known = ", ".join(w.id for w in WORKLOADS)
            raise ValueError(f"--workloads: unknown workload {tok!r} (known: {known})")
        chosen += [w for w in hits if w not in chosen]
    return [w for w in WORKLOADS if w in chosen]  # keep the table order


# ------------------------------------------------------------------------------------------
# inputs


def cos_sin_table(rotary_dim: int, max_position: int, base: float, device) -> torch.Tensor:
    """(max_position, rotary_dim) float32 rows [cos | sin], computed in float64 then rounded."""
    half = rotary_dim // 2
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    ang = torch.arange(max_position, dtype=torch.float64)[:, None] * inv_freq[None, :half]
    return torch.cat((ang.cos(), ang.sin()), dim=-1).to(torch.float32).to(device)


def rotary_dim(wl: Workload, s: Dict[str, int]) -> int:
    return s["R"] if wl.kind == "mla" or "R" in s else s["D"]


def head_cos_sin_table(rotary_dim: int, max_position: int, base: float, heads: int, device) -> torch.Tensor:
    """(max_position, heads, rotary_dim) float32 rows [cos | sin]: head h's frequencies scaled by
    1 + h / heads (each head its own rows), computed in float64 then rounded."""
    half = rotary_dim // 2
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    scale = 1.0 + torch.arange(heads, dtype=torch.float64)[:, None] / heads
    ang = torch.arange(max_position, dtype=torch.float64)[:, None, None] * (scale * inv_freq[None, :half])
    return torch.cat((ang.cos(), ang.sin()), dim=-1).to(torch.float32).to(device)


def make_table(wl: Workload, s: Dict[str, int], device) -> torch.Tensor:
    if wl.kind in AXIAL_KINDS:  # no table: the frequencies take its place in the inputs
        return axial_freqs(wl, device)
    if "head_table" in wl.rope_forms:
        return head_cos_sin_table(rotary_dim(wl, s), s["P"], wl.base, s["Hk"], device)
    return cos_sin_table(rotary_dim(wl, s), s["P"], wl.base, device)


def make_inputs(wl: Workload, s: Dict[str, int], table: torch.Tensor, device, seed: int) -> Dict[str, torch.Tensor]:
    """One input set: contiguous base tensors (the table is shared between sets)."""
    if wl.kind == "rerotate":
        return rerotate_inputs(wl, s, table, device, seed)
    if wl.kind in AXIAL_KINDS:
        return axial_inputs(wl, s, table, device, seed)
    inp = _make_inputs(wl, s, table, device, seed)
    if wl.kind in NORM_KINDS:
        g = torch.Generator(device=device)
        g.manual_seed(seed + 7919)
        for name, n in (("wq", s["D"]), ("wk", s["D"])):  # per-head weights, as trained (around 1)
            inp[name] = (1 + 0.2 * torch.randn(n, generator=g, device=device)).to(DTYPE)
            if wl.norm == "l2":  # no weight: the peers' weighted norms compute it with ones
                inp[name] = torch.ones(n, dtype=DTYPE, device=device)
    if wl.kind in ("store", "normstore"):
        _store_form_inputs(wl, inp)
    return inp


def _store_form_inputs(wl: Workload, inp: Dict[str, torch.Tensor]) -> None:
    """fp8 caches (values cast from the random ones) and the fp8 q_out of the store's forms."""
    if wl.cache_dtype:
        for name in ("k_cache", "v_cache"):
            inp[name] = inp[name].float().to(FP8_OF[wl.cache_dtype])
    if "fp8_q_out" in wl.store_forms:
        inp["q_out"] = torch.empty(inp["q"].shape, dtype=torch.float8_e4m3fn, device=inp["q"].device)
    if "nvfp4" in wl.store_forms:  # zeroed caches: rows no slot names unpack to 0
        for name in ("k_cache", "v_cache"):
            c = inp[name]
            inp[name] = torch.zeros((*c.shape[:-1], c.shape[-1] // 2), dtype=torch.uint8, device=c.device)
            inp[name + "_scales"] = torch.zeros((*c.shape[:-1], c.shape[-1] // 16), dtype=torch.uint8, device=c.device)
            inp[name + "_scales"] = inp[name + "_scales"].view(torch.float8_e4m3fn)


def _make_inputs(wl: Workload, s: Dict[str, int], table: torch.Tensor, device, seed: int) -> Dict[str, torch.Tensor]:
    g = torch.Generator(device=device)
    g.manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, device=device, dtype=torch.float32).to(DTYPE)

    def randint(hi, *shape):
        return torch.randint(0, hi, shape, generator=g, device=device, dtype=torch.int64)

    inp: Dict[str, torch.Tensor] = {"cache": table}
    if wl.kind == "mla":
        T = s["T"]
        inp["q"] = randn(T, s["H"], s["Dq"])
        inp["k_pe"] = randn(T, 1, s["R"])
        inp["positions"] = torch.arange(T, device=device, dtype=torch.int64)
        return inp
    if wl.layout == "bshd":
        B, S = s["B"], s["S"]
        inp["q"] = randn(B, S, s["Hq"], s["D"])
        inp["k"] = randn(B, S, s["Hk"], s["D"])
        if wl.kind in ("fwdbwd", "normfwdbwd"):
            inp["gq"] = randn(B, S, s["Hq"], s["D"])
            inp["gk"] = randn(B, S, s["Hk"], s["D"])
        if {"head_table", "q_temperature"} & set(wl.rope_forms):  # these take explicit positions
            inp["positions"] = torch.arange(S, device=device, dtype=torch.int64).repeat(B, 1)
        return inp  # positions None: arange over S
    T = s["T"]
    inp["q"] = randn(T, s["Hq"], s["D"])
    inp["k"] = randn(T, s["Hk"], s["D"])
    if wl.positions == "arange":
        inp["positions"] = torch.arange(T, device=device, dtype=torch.int64)
    elif wl.positions == "random":
        inp["positions"] = randint(s["P"], T)
    elif wl.positions == "mrope":
        inp["positions"] = randint(s["P"], len(wl.mrope_section), T)
    elif wl.positions == "packed":
        inp["cu_seqlens"], inp["positions"] = packed_positions(T, s["N"], wl.packed[1], seed, device)
    if wl.kind in ("store", "normstore"):
        inp["v"] = randn(T, s["Hk"], s["D"])
        block = s["block"]
        n_blocks = -(-T // block) + max(2, T // block // 16)  # a few blocks stay unused
        inp["k_cache"] = randn(n_blocks, block, s["Hk"], s["D"])
        inp["v_cache"] = randn(n_blocks, block, s["Hk"], s["D"])
        perm = torch.randperm(n_blocks * block, generator=g, device=device)
        inp["slots"] = perm[:T].contiguous()
    return inp


def packed_lengths(T: int, n: int, seed: int) -> List[int]:
    """n positive even lengths summing to T (even: valid under context parallelism too)."""
    g = torch.Generator().manual_seed(seed)
    halves = T // 2
    cuts = torch.randperm(halves - 1, generator=g)[: n - 1].add(1).sort().values.tolist()
    edges = [0] + cuts + [halves]
    return [2 * (b - a) for a, b in zip(edges[:-1], edges[1:])]


def packed_positions(T: int, n: int, cp_size: int, seed: int, device):
    """(cu_seqlens int32 (n+1,), positions int64 (T,)) for rank 0 of cp_size: built here from the
    global sequences (chunks 0 and 2*cp_size-1 of each), independently of ropekit.core.packed."""
    lens = packed_lengths(T, n, seed)
    cu = torch.tensor([0] + lens, dtype=torch.int64).cumsum(0).to(torch.int32)
    pieces = []
    for L in lens:
        chunk = L // 2 if cp_size > 1 else L
        glob = torch.arange(L * cp_size, dtype=torch.int64)
        pieces.append(glob[:chunk] if cp_size == 1 else torch.cat((glob[:chunk], glob[(2 * cp_size - 1) * chunk :])))
    return cu.to(device), torch.cat(pieces).to(device)


def clone_inputs(inp: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """A fresh copy for a check or an in-place peer; the shared table is not copied."""
    return {k: (v if k == "cache" else v.clone()) for k, v in inp.items()}


def hf_positions(wl: Workload, inp: Dict[str, torch.Tensor]) -> torch.Tensor:
    """Positions as an HF model holds them: (B, S) for W1/W8, (1, T) prefill, (T, 1) decode."""
    q = inp["q"]
    if wl.layout == "bshd":
        B, S = q.shape[0], q.shape[1]
        return torch.arange(S, device=q.device).expand(B, S)
    pos = inp["positions"]
    if wl.layout == "decode":
        return pos.unsqueeze(1)
    return pos.unsqueeze(0) if pos.dim() == 1 else pos.unsqueeze(1)  # mrope: (3, 1, T)


def to_hf(wl: Workload, x: torch.Tensor) -> torch.Tensor:
    """Token layout -> the (B, H, S, D) view an HF attention layer passes."""
    if wl.layout == "bshd":
        return x.transpose(1, 2)
    if wl.layout == "decode":
        return x.unsqueeze(1).transpose(1, 2)  # (T, H, 1, D): T sequences of one token
    return x.unsqueeze(0).transpose(1, 2)  # (1, H, T, D)


def from_hf(wl: Workload, x: torch.Tensor) -> torch.Tensor:
    """Inverse of to_hf (a view)."""
    x = x.transpose(1, 2)
    if wl.layout == "bshd":
        return x
    return x.squeeze(1) if wl.layout == "decode" else x.squeeze(0)


# ------------------------------------------------------------------------------------------
# bytes


def min_bytes(wl: Workload, inp: Dict[str, torch.Tensor]) -> int:
    """Bytes that must move (WORKLOADS.md): q and k read and written once (the rotated part for
    W6); the fused store reads q, k, v and writes q and the k and v rows; W8 is two passes."""

    def nb(t):
        return t.numel() * t.element_size()

    if wl.kind == "rerotate":
        return rerotate_min_bytes(wl, inp)
    if wl.kind in NORM_KINDS or wl.kind in AXIAL_KINDS:
        # q and k read and written once (weights negligible); the store writes k and v rows in the
        # cache's dtype; the backward reads x and g and writes gx, for q and for k
        qk = nb(inp["q"]) + nb(inp["k"])
        if wl.kind in ("normrope", "axial"):
            return 2 * qk
        if wl.kind in ("normfwdbwd", "axialfb"):
            return 2 * qk + 3 * qk
        return store_bytes(wl, inp)
    if wl.kind == "mla":
        R = inp["k_pe"].shape[-1]
        q_pe = inp["q"][..., -R:]
        return 2 * (nb(q_pe) + nb(inp["k_pe"]))
    if wl.kind == "store":
        return store_bytes(wl, inp)
    one = 2 * (nb(inp["q"]) + nb(inp["k"]))
    return 2 * one if wl.kind == "fwdbwd" else one


def store_bytes(wl: Workload, inp: Dict[str, torch.Tensor]) -> int:
    """The fused store: q, k, v read; q written (or q_out); the k and v rows written in the
    cache's dtype; k written again with write_key. q rotated in place by a table narrower than
    its head (partial rotary, the k_nope rows): only its rotated dims are read and written."""

    def nb(t):
        return t.numel() * t.element_size()

    rows = (inp["k"].numel() + inp["v"].numel()) * inp["k_cache"].element_size()
    if "nvfp4" in wl.store_forms:  # the packed bytes moved: half a byte a value, one scale byte per 16
        rows = (inp["k"].numel() + inp["v"].numel()) * 9 // 16
    q_written = nb(inp["q_out"]) if "q_out" in inp else nb(inp["q"])
    q_read, rot = nb(inp["q"]), inp["cache"].shape[-1]
    if "q_out" not in inp and wl.kind == "store" and rot < inp["q"].shape[-1]:
        q_read = q_written = nb(inp["q"]) * rot // inp["q"].shape[-1]  # in place: the tail is not touched
    k_back = nb(inp["k"]) if "write_key" in wl.store_forms else 0
    return q_read + q_written + nb(inp["k"]) + nb(inp["v"]) + rows + k_back


def as_stored(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """float64 values as a correct kernel leaves them in an fp8 output of scale `scale` (the float32
    value / scale rounded once), dequantized; other dtypes: x as is (the tolerance covers rounding)."""
    if dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        return x
    return (x.float() / scale).to(dtype).to(torch.float64) * scale


# ------------------------------------------------------------------------------------------
# the float64 oracle


def _local_rows(mrope_section, mrope_layout, device) -> torch.Tensor:
    """The position row of each pair, the bench's own: sections in order (chunked), or ERNIE 4.5-VL's
    (spatial sections first, their rows taking turns pair by pair; the last section, row 0, at the end)."""
    if mrope_layout is None:
        rows = [r for r, n in enumerate(mrope_section) for _ in range(n)]
    elif mrope_layout == "ernie":
        *spatial, t = mrope_section
        rows = [1 + j % len(spatial) for j in range(sum(spatial))] + [0] * t
    else:
        raise ValueError(f"the bench's float64 formula has no M-RoPE layout {mrope_layout!r}")
    return torch.tensor(rows, device=device)


def _local_rope64(x, positions, table, interleaved, mrope_section, mrope_layout=None):
    """Independent float64 RoPE (the bench's own formula), used to cross-check ropekit.tools.reference."""
    x = x.to(torch.float64)
    table = table.to(torch.float64)
    R = table.shape[-1]
    half = R // 2
    tok = x.shape[:-2]
    if positions is None:
        positions = torch.arange(tok[-1], device=x.device).expand(*tok)
    rows = table[positions.long()]
    if table.dim() == 3:  # a per-head table: each of the Ht heads' rows for its H / Ht heads of x
        rows = rows.repeat_interleave(x.shape[-2] // table.shape[1], dim=-2)
    cos, sin = rows[..., :half], rows[..., half:]
    if mrope_section is not None:
        sec = _local_rows(mrope_section, mrope_layout, x.device)
        pick = sec.view(1, *([1] * len(tok)), half).expand(1, *cos.shape[1:])
        cos, sin = cos.gather(0, pick).squeeze(0), sin.gather(0, pick).squeeze(0)
    c, s_ = (cos, sin) if table.dim() == 3 else (cos.unsqueeze(-2), sin.unsqueeze(-2))
    xr = x[..., :R]
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        o = torch.stack((x1 * c - x2 * s_, x2 * c + x1 * s_), dim=-1).flatten(-2)
    else:
        x1, x2 = xr[..., :half], xr[..., half:]
        o = torch.cat((x1 * c - x2 * s_, x2 * c + x1 * s_), dim=-1)
    return torch.cat((o, x[..., R:]), dim=-1)


@dataclass
class Oracle:
    """float64 RoPE: ropekit.tools.reference.apply_rope when it takes float64, else the bench's own.

    Both are computed when ropekit.tools.reference is there; a disagreement is recorded (and printed)
    so a bug in the oracle can't silently mark every implementation wrong or right."""

    name: str = ""
    disagreements: List[str] = field(default_factory=list)

    def rope(self, x, positions, table, *, interleaved=False, mrope_section=None, mrope_layout=None, label=""):
        local = _local_rope64(x, positions, table, interleaved, mrope_section, mrope_layout)
        try:
            from ropekit.tools import reference

            ref, _ = reference.apply_rope(
                x.to(torch.float64),
                None,
                positions,
                table.to(torch.float64),
                interleaved=interleaved,
                mrope_section=mrope_section,
                mrope_layout=mrope_layout,
            )
            ref = ref.to(torch.float64)
        except Exception as e:  # not there yet, or no float64: use ours
            self.name = f"bench-local float64 (ropekit.tools.reference unavailable: {type(e).__name__})"
            return local
        self.name = "ropekit.tools.reference.apply_rope in float64 (cross-checked with the bench's own)"
        err = rel_err(ref, local)
        if not err <= 1e-9:
            self.disagreements.append(f"{label}: ropekit.tools.reference vs bench float64 rel err {err:.2e}")
        return ref


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; NaN anywhere gives inf."""
    o = out.detach().to(torch.float64)
    r = ref.detach().to(torch.float64)
    if o.shape != r.shape:
        raise ValueError(f"shape {tuple(o.shape)} != expected {tuple(r.shape)}")
    if not bool(torch.isfinite(o).all()):
        return math.inf
    den = float(r.norm())
    num = float((o - r).norm())
    return num / den if den > 0 else num


def expected(wl: Workload, inp: Dict[str, torch.Tensor], oracle: Oracle) -> Dict[str, torch.Tensor]:
    """float64 expected outputs, named as `canon` names them. Call on pristine inputs."""
    if wl.kind == "rerotate":
        return rerotate_expected(wl, inp)
    if wl.kind in AXIAL_KINDS:
        return axial_expected(wl, inp)
    if wl.kind in NORM_KINDS:
        return _expected_norm(wl, inp, oracle)
    tab = inp["cache"]
    il, ms = wl.interleaved, wl.mrope_section
    pos = inp.get("positions")
    if wl.kind == "mla":
        R = inp["k_pe"].shape[-1]
        q = inp["q"].to(torch.float64)
        q[..., -R:] = oracle.rope(inp["q"][..., -R:], pos, tab, interleaved=il, label=wl.id + " q_pe")
        return {"q": q, "k_pe": oracle.rope(inp["k_pe"], pos, tab, interleaved=il, label=wl.id + " k_pe")}
    ml = wl.mrope_layout
    q = oracle.rope(inp["q"], pos, tab, interleaved=il, mrope_section=ms, mrope_layout=ml, label=wl.id + " q")
    k = oracle.rope(inp["k"], pos, tab, interleaved=il, mrope_section=ms, mrope_layout=ml, label=wl.id + " k")
    if "q_temperature" in wl.rope_forms:  # q times its token's factor (ropekit.tools.reference's formula)
        floor_scale, attn_scale = Q_TEMPERATURE
        p = pos.to(torch.float64)
        q = q * (torch.log(torch.floor((p + 1) / floor_scale) + 1) * attn_scale + 1)[..., None, None]
    if wl.kind == "rope":
        return {"q": q, "k": k}
    if wl.kind == "fwdbwd":
        half = tab.shape[-1] // 2
        inv = torch.cat((tab[:, :half], -tab[:, half:]), dim=-1)  # backward: rotate by -angle
        return {
            "q": q,
            "k": k,
            "dq": oracle.rope(inp["gq"], pos, inv, interleaved=il, label=wl.id + " dq"),
            "dk": oracle.rope(inp["gk"], pos, inv, interleaved=il, label=wl.id + " dk"),
        }
    return _expected_store(wl, inp, q, k)


def _expected_store(wl: Workload, inp: Dict[str, torch.Tensor], q, k) -> Dict[str, torch.Tensor]:
    """The store's outputs from float64 rotated (normalized) q and k: q (as q_out holds it), the
    written rows (as the cache's dtype holds them) and the other rows unchanged; k with write_key."""
    slots, other = _slot_split(inp)
    if "nvfp4" in wl.store_forms:
        return _expected_nvfp4(wl, inp, q, k)
    kc = inp["k_cache"].flatten(0, 1).to(torch.float64)
    vc = inp["v_cache"].flatten(0, 1).to(torch.float64)
    cdt = inp["k_cache"].dtype
    out = {
        "q": as_stored(q, torch.float8_e4m3fn, Q_SCALE) if "q_out" in inp else q,
        "k_cache[slots]": as_stored(k, cdt),
        "v_cache[slots]": as_stored(inp["v"].to(torch.float64), cdt),
        "k_cache[other]": kc[other],
        "v_cache[other]": vc[other],
    }
    if "write_key" in wl.store_forms:
        out["k"] = k
    return out


def nvfp4_values(inp: Dict[str, torch.Tensor], codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """An NVFP4 cache's values (float64, (..., D)) at the bench's global scale (the oracle's unpack)."""
    return nvfp4_unpack(codes, scales, NVFP4_GLOBAL)


def _expected_nvfp4(wl: Workload, inp: Dict[str, torch.Tensor], q, k) -> Dict[str, torch.Tensor]:
    """The nvfp4 form's outputs: the float64 rotated k and v quantized and dequantized by the
    oracle's rule (ropekit.tools.reference.nvfp4_quantize), the other rows as they were."""
    slots, other = _slot_split(inp)
    out = {"q": q}
    for name, x in (("k_cache", k), ("v_cache", inp["v"].to(torch.float64))):
        vals = nvfp4_dequantize(*nvfp4_quantize(x, NVFP4_GLOBAL), NVFP4_GLOBAL)
        out[name + "[slots]"] = vals
        out[name + "[other]"] = nvfp4_values(inp, inp[name], inp[name + "_scales"]).flatten(0, 1)[other]
    return out


def _slot_split(inp):
    slots = inp["slots"].long()
    n = inp["k_cache"].shape[0] * inp["k_cache"].shape[1]
    used = torch.zeros(n, dtype=torch.bool, device=slots.device)
    used[slots] = True
    return slots, (~used).nonzero().squeeze(1)


def canon(wl: Workload, inp: Dict[str, torch.Tensor], outs: Sequence[torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Name an implementation's canonical outputs the way `expected` names them."""
    if wl.kind == "rerotate":
        return rerotate_canon(wl, inp, outs)
    if wl.kind in ("normrope", "axial"):
        return {"q": outs[0], "k": outs[1]}
    if wl.kind in ("normfwdbwd", "axialfb"):
        return dict(zip(("q", "k", "dq", "dk", "dwq", "dwk"), outs))
    if wl.kind == "normstore":
        return canon(replace(wl, kind="store"), inp, outs)
    if wl.kind == "mla":
        return {"q": outs[0], "k_pe": outs[1]}
    if wl.kind == "rope":
        return {"q": outs[0], "k": outs[1]}
    if wl.kind == "fwdbwd":
        return {"q": outs[0], "k": outs[1], "dq": outs[2], "dk": outs[3]}
    q, kc, vc = outs[:3]
    slots, other = _slot_split(inp)
    kc, vc = kc.flatten(0, 1), vc.flatten(0, 1)
    got = {
        "q": q.to(torch.float64) * Q_SCALE if q.element_size() == 1 else q,
        "k_cache[slots]": kc[slots],
        "v_cache[slots]": vc[slots],
        "k_cache[other]": kc[other],
        "v_cache[other]": vc[other],
    }
    if len(outs) > 3:  # write_key: k after the call
        got["k"] = outs[3]
    return got


def tolerance(dtype: torch.dtype) -> float:
    return {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float8_e4m3fn: 5e-2}.get(dtype, 1e-4)


# ------------------------------------------------------------------------------------------
# W12: re-rotation of cached keys (ropekit.rerotate_kv_cache)
#
# Inputs: "k_cache" a paged (num_blocks, block, H, D) cache holding twice as many slots as rows to
# move (bf16, fp8 or the MLA joint row [latent | rope]); "slots" N distinct random rows; "delta" N
# random shifts in (-P, P); "q" only carries the cache dtype (the runner picks the tolerance from
# it). Every implementation re-rotates the rope dims of those rows in place; the canonical output is
# the whole cache, split into the moved rows and all others (which must not change).

_FP8 = torch.float8_e4m3fn
W12_K_SCALE = 0.05  # fp8: values / scale stay well inside e4m3's range
# W12-2T's second table: YaRN at this factor, its attention factor folded in (a magnitude other
# than the first table's 1, so the composition's division is exercised)
W12_TO_YARN = 4.0


def rerotate_view(wl: Workload, cache: torch.Tensor) -> torch.Tensor:
    """The rope part a re-rotation works on: the whole cache, or MLA's last R dims of the joint row."""
    return cache[..., -wl.full["R"] :] if "R" in wl.full else cache


def rerotate_inputs(wl: Workload, s: Dict[str, int], table: torch.Tensor, device, seed: int):
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    N, block = s["N"], s["block"]
    n_blocks = -(-2 * N // block)
    width = s["L"] + s["R"] if "R" in s else s["D"]
    heads = 1 if "R" in s else s["H"]
    values = torch.randn(n_blocks, block, heads, width, generator=g, device=device)
    dtype = _FP8 if s.get("fp8") else DTYPE
    cache = (values / W12_K_SCALE).to(_FP8) if dtype == _FP8 else values.to(dtype)
    slots = torch.randperm(n_blocks * block, generator=g, device=device)[:N].contiguous()
    delta = torch.randint(-s["P"] + 1, s["P"], (N,), generator=g, device=device)
    inp = {
        "cache": table,
        "k_cache": cache,
        "slots": slots,
        "delta": delta,
        "q": torch.empty(0, dtype=dtype, device=device),
    }
    if s.get("two"):  # a move between tables: stored positions, shifts that land inside to_cache
        inp["positions"] = torch.randint(0, s["P"], (N,), generator=g, device=device)
        inp["delta"] = torch.randint(0, s["P"], (N,), generator=g, device=device) - inp["positions"]
        from ropekit import cos_sin_cache  # HF's YaRN table, attention factor folded in

        scaling = {"rope_type": "yarn", "factor": W12_TO_YARN, "original_max_position_embeddings": s["P"] // 4}
        inp["to_cache"] = cos_sin_cache(table.shape[1], s["P"], wl.base, scaling, device=device)
    return inp


def rerotate_min_bytes(wl: Workload, inp: Dict[str, torch.Tensor]) -> int:
    """The rope dims of the moved rows read and written once, plus the slots and shifts read (W12-2T
    counts the same bytes: its positions and second table rows are left out, so its percent of copy
    compares with W12's)."""
    rows = rerotate_view(wl, inp["k_cache"]).flatten(0, 1)[: inp["slots"].shape[0]]
    return 2 * rows.numel() * rows.element_size() + 2 * inp["slots"].numel() * 8


def _rerotate_split(inp, cache):
    rows = cache.flatten(0, 1)
    used = torch.zeros(rows.shape[0], dtype=torch.bool, device=rows.device)
    used[inp["slots"]] = True
    return rows[inp["slots"]], rows[~used]


def rerotate_expected(wl: Workload, inp: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """float64 cache after the call: ropekit.tools.reference on a float64 copy (dequantized for fp8)."""
    from ropekit.tools import reference

    fp8 = inp["k_cache"].dtype == _FP8
    cache = inp["k_cache"].to(torch.float64) * (W12_K_SCALE if fp8 else 1.0)
    two = {}
    if "to_cache" in inp:
        two = dict(positions=inp["positions"], to_cache=inp["to_cache"].double())
    reference.rerotate_kv_cache(
        rerotate_view(wl, cache), inp["slots"], inp["delta"], inp["cache"].double(), interleaved=wl.interleaved, **two
    )
    moved, other = _rerotate_split(inp, cache)
    return {"k_cache[slots]": moved, "k_cache[other]": other}


def rerotate_canon(wl: Workload, inp: Dict[str, torch.Tensor], outs) -> Dict[str, torch.Tensor]:
    cache = outs[0]
    if cache.dtype == _FP8:
        cache = cache.to(torch.float64) * W12_K_SCALE  # as `rerotate_expected` dequantizes
    moved, other = _rerotate_split(inp, cache)
    return {"k_cache[slots]": moved, "k_cache[other]": other}


def _w12(**kw):
    return dict(P=65536, block=16, **kw)


WORKLOADS += [
    Workload(
        "W12",
        "rerotate",
        "rerotate",
        "re-rotate 65,536 random rows of a paged bf16 cache (8 heads x 128) by random deltas, in place",
        full=_w12(N=65536, H=8, D=128),
        quick=_w12(N=256, H=8, D=128),
        positions="random",
    ),
    Workload(
        "W12-fp8",
        "rerotate_fp8",
        "rerotate",
        "W12 on an fp8 (e4m3) cache, k_scale 0.05",
        full=_w12(N=65536, H=8, D=128, fp8=1),
        quick=_w12(N=256, H=8, D=128, fp8=1),
        positions="random",
    ),
    Workload(
        "W12-2T",
        "rerotate_two_tables",
        "rerotate",
        "W12's rows moved between tables (stored positions, to a YaRN table of factor 4) by random "
        "deltas, one pass; bytes as W12's",
        full=_w12(N=65536, H=8, D=128, two=1),
        quick=_w12(N=256, H=8, D=128, two=1),
        positions="random",
    ),
    Workload(
        "W12-mla",
        "rerotate_mla",
        "rerotate",
        "W12 on DeepSeek's MLA joint cache: the 64 rope dims of 576-wide rows, interleaved "
        "(17 MB: an eager call is host-bound, so it is timed under CUDA-graph replay, host time apart)",
        full=_w12(N=65536, L=512, R=64),
        quick=_w12(N=256, L=512, R=64),
        positions="random",
        interleaved=True,
        base=10000.0,
        graph=True,
        host=True,
    ),
]
BY_ID.update({w.id: w for w in WORKLOADS})


def _expected_norm(wl: Workload, inp: Dict[str, torch.Tensor], oracle: Oracle) -> Dict[str, torch.Tensor]:
    """float64 RMSNorm + RoPE (ropekit.tools.reference.rms_norm_rope; its rotation is cross-checked by
    the bench's own formula on the normalized inputs), gradients by float64 autograd."""
    from ropekit.tools import reference

    d = lambda t: t.detach().to(torch.float64)  # noqa: E731
    pos, tab = inp.get("positions"), inp["cache"]
    q64, k64 = d(inp["q"]).requires_grad_(True), d(inp["k"]).requires_grad_(True)
    wq64, wk64 = d(inp["wq"]).requires_grad_(True), d(inp["wk"]).requires_grad_(True)
    with torch.enable_grad():
        q, k = reference.rms_norm_rope(q64, k64, pos, d(tab), q_norm_weight=wq64, k_norm_weight=wk64, norm_eps=NORM_EPS)
    qn = reference.rms_norm(d(inp["q"]), d(inp["wq"]), eps=NORM_EPS)
    local = _local_rope64(qn, pos, tab, False, None)
    if not rel_err(q, local) <= 1e-9:
        oracle.disagreements.append(f"{wl.id}: reference.rms_norm_rope vs bench float64 rotation")
    if wl.kind == "normrope":
        return {"q": q.detach(), "k": k.detach()}
    if wl.kind == "normfwdbwd":
        grads = torch.autograd.grad((q, k), (q64, k64, wq64, wk64), (d(inp["gq"]), d(inp["gk"])))
        return dict(zip(("q", "k", "dq", "dk", "dwq", "dwk"), (q.detach(), k.detach(), *grads)))
    # fp8 rows and q_out: what a correct kernel stores, the float32 value rounded once
    return _expected_store(wl, inp, q.detach(), k.detach())


# ------------------------------------------------------------------------------------------
# W13-W15: axial (N-D) RoPE of image and video transformers, angles from positions x frequencies
#
# Inputs: "q", "k" (B, S, H, D) bf16; "positions" (axes, B, S) (int grids, broadcast over the
# batch, or float ViT coordinates per image); "cache" the float32 frequencies (no table);
# "cos", "sin" (S, D) or (B, S, D) float32 with every frequency repeated in pairs, as diffusers'
# position embeddings hand them to its attention processors (computed once per forward: not timed);
# norm weights "wq", "wk" ((D,) per head, (H * D,) across heads); "gq", "gk" for forward+backward.

AXIAL_KINDS = ("axial", "axialfb")


def axial_freqs(wl: Workload, device) -> torch.Tensor:
    """float32 frequencies: each axis's 1 / theta ** (2j / d) from its own width d (float64, rounded)."""
    parts = [1.0 / wl.base ** (torch.arange(0, d, 2, dtype=torch.float64) / d) for d in wl.axes_dim]
    return torch.cat(parts).to(torch.float32).to(device)


def _grid(shape, device) -> torch.Tensor:
    """(len(shape), prod(shape)) integer coordinates of a row-major grid."""
    axes = [torch.arange(n, device=device) for n in shape]
    return torch.stack([a.flatten() for a in torch.meshgrid(*axes, indexing="ij")])


def axial_positions(wl: Workload, s: Dict[str, int], device, g) -> torch.Tensor:
    B = s["B"]
    if "F" in s:  # video (frames, rows, columns)
        pos = _grid((s["F"], s["Hp"], s["Wp"]), device)
    elif "Txt" in s:  # Flux: text ids (0, 0, 0), then the image's (0, row, column)
        img = _grid((1, s["Hp"], s["Wp"]), device)
        pos = torch.cat((torch.zeros(3, s["Txt"], dtype=img.dtype, device=device), img), dim=1)
    else:  # ViT: patch centres in [-1, 1], jittered per image (float coordinates)
        side = s["Hp"]
        c = (torch.arange(side, device=device, dtype=torch.float32) + 0.5) / side * 2 - 1
        grid = torch.stack(torch.meshgrid(c, c, indexing="ij")).flatten(1)  # (2, N)
        jitter = 1 + 0.1 * torch.randn(2, B, 1, generator=g, device=device)
        return (grid[:, None, :] * jitter).contiguous()
    return pos[:, None, :].expand(pos.shape[0], B, pos.shape[1])


def axial_inputs(wl: Workload, s: Dict[str, int], freqs: torch.Tensor, device, seed: int):
    g = torch.Generator(device=device)
    g.manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, device=device, dtype=torch.float32).to(DTYPE)

    pos = axial_positions(wl, s, device, g)
    B, S, H, D = s["B"], pos.shape[-1], s["H"], s["D"]
    angle = pos.double()[..., None] * freqs.double()  # (axes, B, S, half): pick each pair's axis
    rows = torch.repeat_interleave(
        torch.arange(len(wl.axes_dim), device=device), torch.tensor(wl.axes_dim, device=device) // 2
    )
    angle = angle[rows, :, :, torch.arange(rows.shape[0], device=device)].permute(1, 2, 0)  # (B, S, half)
    if pos.stride(1) == 0:
        angle = angle[0]  # one grid for the batch: (S, half), as diffusers holds it
    inp = {
        "cache": freqs,
        "positions": pos,
        "q": randn(B, S, H, D),
        "k": randn(B, S, H, D),
        "cos": angle.cos().float().repeat_interleave(2, dim=-1),
        "sin": angle.sin().float().repeat_interleave(2, dim=-1),
    }
    if wl.norm:
        n = D if wl.norm == "head" else H * D
        inp["wq"] = (1 + 0.2 * torch.randn(n, generator=g, device=device)).to(DTYPE)
        inp["wk"] = (1 + 0.2 * torch.randn(n, generator=g, device=device)).to(DTYPE)
    if wl.kind == "axialfb":
        inp["gq"], inp["gk"] = randn(B, S, H, D), randn(B, S, H, D)
    return inp


def axial_rms_norm(x, w, eps: float = NORM_EPS):
    """RMSNorm in float32 (float64 for float64 x) over each head, or all heads for (H * D,) weights."""
    ct = torch.float64 if x.dtype == torch.float64 else torch.float32
    xs = x.to(ct) if w.shape[0] == x.shape[-1] else x.to(ct).flatten(-2)
    y = xs * torch.rsqrt(xs.pow(2).mean(-1, keepdim=True) + eps) * w.to(ct)
    return y.view(x.shape)


def diffusers_rotate(x, cos, sin):
    """diffusers' apply_rotary_emb (use_real, pairs (2i, 2i+1)): x * cos + rotated * sin in float32,
    cos / sin (S, D) or (B, S, D) with every frequency repeated in pairs."""
    real, imag = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
    rotated = torch.stack((-imag, real), dim=-1).flatten(-2)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # over heads
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


def axial_expected(wl: Workload, inp: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """float64: norm (if any) then the rotation by float64 angles; gradients by float64 autograd."""
    d = lambda t: t.detach().to(torch.float64)  # noqa: E731
    q64, k64 = d(inp["q"]).requires_grad_(True), d(inp["k"]).requires_grad_(True)
    leaves = [q64, k64]
    ws = [None, None]
    if wl.norm:
        ws = [d(inp["wq"]).requires_grad_(True), d(inp["wk"]).requires_grad_(True)]
        leaves += ws
    cos, sin = d(inp["cos"]), d(inp["sin"])
    with torch.enable_grad():
        outs = [diffusers_rotate(x if w is None else axial_rms_norm(x, w), cos, sin) for x, w in zip((q64, k64), ws)]
    if wl.kind == "axial":
        return {"q": outs[0].detach(), "k": outs[1].detach()}
    grads = torch.autograd.grad(outs, leaves, (d(inp["gq"]), d(inp["gk"])))
    names = ("q", "k", "dq", "dk", "dwq", "dwk")
    return dict(zip(names, (outs[0].detach(), outs[1].detach(), *grads)))


def _flux(**kw):
    return dict(B=1, Txt=512, Hp=64, Wp=64, H=24, D=128, **kw)


def _wan(**kw):
    return dict(B=1, F=21, Hp=45, Wp=80, H=40, D=128, **kw)


_FLUX_Q = dict(B=1, Txt=16, Hp=8, Wp=8, H=24, D=128)
_WAN_Q = dict(B=1, F=3, Hp=4, Wp=6, H=40, D=128)

_W13 = Workload(
    "W13",
    "flux",
    "axial",
    "Flux.1 prologue: per-head QK-RMSNorm + axial RoPE (16, 56, 56), 4096 image + 512 text tokens",
    full=_flux(),
    quick=_FLUX_Q,
    interleaved=True,
    base=10000.0,
    axes_dim=(16, 56, 56),
    norm="head",
)
_W14 = Workload(
    "W14",
    "wan",
    "axial",
    "Wan 2.1 14B prologue: QK-RMSNorm across 40 heads + 3D RoPE (44, 42, 42), 21x45x80 tokens",
    full=_wan(),
    quick=_WAN_Q,
    interleaved=True,
    base=10000.0,
    axes_dim=(44, 42, 42),
    norm="heads",
)
_FB = "through autograd, forward then backward (q, k and both norm weights)"
WORKLOADS += [
    _W13,
    replace(_W13, id="W13-FB", name="flux_fwd_bwd", kind="axialfb", what="W13 " + _FB),
    # W13's kernel (~35 us) is shorter than its eager host path: do_bench's per-call events can
    # enclose the launch, so the kernel's own figure is this row's
    replace(_W13, id="W13-G", name="flux_graph", graph=True, what="W13 under CUDA-graph replay"),
    _W14,
    replace(_W14, id="W14-FB", name="wan_fwd_bwd", kind="axialfb", what="W14 " + _FB),
    Workload(
        "W15",
        "vit2d",
        "axial",
        "2D ViT, float (rescaled, jittered) patch coordinates, angles in the kernel: 64 images x 1024 patches",
        full=dict(B=64, Hp=32, H=16, D=64),
        quick=dict(B=2, Hp=4, H=16, D=64),
        interleaved=True,
        base=100.0,
        axes_dim=(32, 32),
    ),
]
BY_ID.update({w.id: w for w in WORKLOADS})
