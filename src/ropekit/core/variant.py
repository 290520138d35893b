"""The one record of a call: every flag of every op (`Variant`), what validation concluded about a
call signature (`Spec`), the flag table the record is built from, and the custom ops' encoding.

    Variant     frozen, hashable: every flag a kernel, a launch plan or the CPU path branches on,
                for the rotation, the fused store and the re-rotation alike. Parsed once from the
                public call (ropekit.core.checks), then read by name everywhere; the custom ops take
                it as one int list (`encode` / `decode`, derived from the fields).
    Spec        the Variant of one call signature plus the rotary width, the door, the launch plans
                once made, and what the per-call checks need (extents, angle layouts).
    FLAGS       the flag table: each flag of the record declared once (see Flag).
    Signature   an op's parameters as ropekit.core.pipeline.prepare reads them for the signature key.

Adding a boolean flag of apply_rope: a row in FLAGS (the record's field, its default, each kernel's
constexpr of it, its backward rule, its keyword; the custom-op encoding, the plans' constexpr
passing, Variant.backward and the keyword's parsing follow from the row), the keyword on the public
op (its signature, docstring and prepare's tuple), its branch in the kernel, in ropekit.core.cpu and
in the oracle ropekit.tools.reference: five files. What it does not compose with is the row's
`refuses` (eager_rounding: a fused norm), which checks.refusals reads for every op alike. A flag
that brings operands of its own (a tensor, a stride, a float) adds their validation (checks,
rules), their launch arguments (plans) and the run step that passes them (pipeline, run):
head_table (a per-head table's head stride) and fp4 (two scale tensors) took 9 and 11 source files.
"""

from __future__ import annotations

import collections
import inspect
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from .memo import remembered, value_key

# Variant.mrope: how a pair finds its position row. The two three-row layouts of Qwen2-VL / Qwen3-VL
# are computed in the kernel from the sections; every other layout reads Variant.axis_map (one
# int32 entry per pair, a small tensor the launch passes in place of the sections)
MROPE_CHUNKED, MROPE_INTERLEAVED, MROPE_MAP = 1, 2, 3
# apply_rope's mrope_layout presets (mrope_axes gives each one's map)
MROPE_LAYOUTS = ("chunked", "interleaved", "ernie", "bailing", "pangu")
# Variant.norm_q / norm_k: none, each head, all heads of a token, each head without a weight
# (apply_rope's l2_norm: Llama 4's norm after the rotation, which equals one before it, since a
# rotation keeps the sum of squares of a head)
NORM_NONE, NORM_HEAD, NORM_TOKEN, NORM_UNIT = 0, 1, 2, 3
# where the angles come from (Variant.angles); the index is the custom ops' code for each
ANGLE_SOURCES = ("table", "arange", "packed", "tokens", "freqs", "delta")
# what each angle source's operands (a, b) are called in errors and in the sharding rules
ANGLE_NAMES = {
    "table": ("positions", "cos_sin_cache"),
    "arange": ("positions", "cos_sin_cache"),
    "packed": ("cu_seqlens", "cos_sin_cache"),
    "tokens": ("cos", "sin"),
    "freqs": ("positions", "inv_freq"),
    "delta": ("delta", "cos_sin_cache"),
}
# the doors of a call (ropekit.core.dispatch): eager without and with autograd, the dispatcher
# (tensor subclasses, meta), and the dispatcher while torch.compile traces (no per-call checks)
DIRECT, FUNCTION, CUSTOM_OP, TRACED = "direct", "function", "custom_op", "traced"
# the direct door's steady state: a spec's launch record (ropekit.core.pipeline.rotate_record), taken
# by the ops before the spec's door once rotate_direct has made the record; None: declined
RECORD = "record"


class Flag(NamedTuple):
    """One flag of the call record, declared once: everything a reader follows it by.

    name       the Variant field (what every branch reads: `variant.<name>`)
    default    its value when the call does not set it (its type is the field's)
    constexpr  the kernels' tl.constexpr of it, by kernel: plans.kernel_flags passes exactly these
    backward   how the backward rotation sets it (Variant.backward): "keep", "negate", or
               "from <field>" (the backward reads the forward's output layout)
    coded      in the custom ops' int-list encoding (False: a view flag the ops never see)
    keyword    the ops' boolean keyword that sets it as given (checks.keyword_flags parses every
               such row alike, for each op that has the keyword: a bool, else an error naming the
               keyword); None: set by other rules
    refuses    the fields this flag does not compose with, and why: a call that sets it and any of
               them is refused (checks.refusals, every row alike), the error naming this flag's
               keyword and the other field's argument (its row's `named`)
    named      how errors name the argument that set this field, by value ({}: its keyword=value)
    what       what it means
    """

    name: str
    default: object
    constexpr: Dict[str, str]
    backward: str = "keep"
    coded: bool = True
    keyword: Optional[str] = None
    refuses: Tuple[Tuple[str, ...], str] = ((), "")
    named: Dict[object, str] = {}
    what: str = ""


_ROPE, _STORE = "rope_kernel", "rope_store_kernel"
_REROTATE, _NORM_BACKWARD = "rerotate_kernel", "rope_norm_backward_kernel"


def _in(name: str, *kernels: str) -> Dict[str, str]:
    return {kernel: name for kernel in kernels}


# fmt: off
FLAGS: Tuple[Flag, ...] = (
    Flag("interleaved", False, _in("INTERLEAVED", _ROPE, _STORE, _REROTATE, _NORM_BACKWARD), "from out_interleaved",
         what="input pairs are (2i, 2i+1); False: halves (i, i + rotary_dim/2)"),
    Flag("out_interleaved", False, _in("OUT_INTERLEAVED", _ROPE, _NORM_BACKWARD), "from interleaved",
         what="the layout the rotated pairs are written in (DeepSeek-V3's HF code reads pairs, writes halves)"),
    Flag("mrope", 0, _in("MROPE", _ROPE, _STORE, _NORM_BACKWARD),
         what="0 none, MROPE_CHUNKED (Qwen2-VL), MROPE_INTERLEAVED (Qwen3-VL), MROPE_MAP (any other "
              "layout or number of position rows: the kernels read axis_map)"),
    Flag("sections", (0, 0, 0), {}, coded=False,
         what="M-RoPE's frequencies per section (mrope_section as given, N >= 1 of them); with 'freqs' "
              "angles the pairs of each axis, () for one position row (encoded after the coded flags)"),
    Flag("angles", "table", {},
         what="where the angles come from (ANGLE_SOURCES): 'table' rows of a [cos | sin] table picked by "
              "positions; 'freqs' positions x inverse frequencies, in the kernel; 'arange' row s for token "
              "(b, s); 'tokens' per-token cos / sin; 'delta' row |delta| per cache row, sin negated for "
              "delta < 0; 'packed' table rows at positions derived from cu_seqlens"),
    Flag("inverse", False, _in("INVERSE", _ROPE, _NORM_BACKWARD), "negate", keyword="inverse",
         what="rotate by -angle: the backward pass, or a de-rotation (apply_rope(inverse=True))"),
    Flag("heads_first", False, {}, coded=False,
         what="q, k (and their gradients) are (B, H, S, D) views (Hugging Face)"),
    Flag("scaled", False, _in("SCALED", _ROPE, _STORE),
         what="the rotated outputs (q_out / k_out; the store's q_out) divided by a per-tensor scale, "
              "saturated to an fp8 output's range"),
    Flag("norm_q", 0, _in("NORM_Q", _ROPE, _STORE),
         named={NORM_HEAD: "q_norm_weight", NORM_TOKEN: "q_norm_weight", NORM_UNIT: "l2_norm=True"},
         what="RMSNorm of q before the rotation: NORM_NONE, NORM_HEAD ((D,) weight), NORM_TOKEN ((H*D,)), "
              "NORM_UNIT (each head, no weight: l2_norm)"),
    Flag("norm_k", 0, _in("NORM_K", _ROPE, _STORE),
         named={NORM_HEAD: "k_norm_weight", NORM_TOKEN: "k_norm_weight", NORM_UNIT: "l2_norm=True"},
         what="RMSNorm of k likewise"),
    Flag("seq_first", False, {}, coded=False,
         what="q, k (and given outputs) are (S, B, H, D) (Transformer Engine's 'sbhd'): the rotation's "
              "views hand the run (B, S, H, D) views, transpose(0, 1)"),
    Flag("rope_last", False, {}, coded=False,
         what="the rotated dims are the last rotary_dim of the head ([nope | rope], DeepSeek): the run "
              "gets views of that part, the rest is copied"),
    Flag("rope_halves", False, {},
         what="half-split pairs (i, i + D/2), i < rotary_dim / 2, of the whole head "
              "(rotary_position='halves', Gemma 4's p-RoPE): the plans' GAP is D/2 and the kept dims are "
              "[rotary_dim/2, D/2) and [D/2 + rotary_dim/2, D)"),
    Flag("nope_q", False, _in("NOPE_Q", _STORE),
         what="q is the rope part of the head and q_nope, a tensor of its own, the rest (FlashInfer's "
              "q_rope / q_nope): the store's kernel reads q_out's dims past the rotated ones from it; "
              "apply_rope's output joins it (ops.py, a view form)"),
    Flag("nope_k", False, _in("NOPE_K", _STORE),
         what="k likewise with k_nope: the store's k cache row (beside v, GQA / MHA), or apply_rope's k output"),
    Flag("q_out", False, {}, what="store: q rotated into a given q_out (its tail copied), q left untouched"),
    Flag("write_key", False, _in("WRITE_KEY", _STORE), what="store: rotated (and normalized) k written back into k too"),
    Flag("k_scaled", False, _in("K_SCALED", _STORE, _REROTATE), what="store, re-rotation: the k cache holds value / k_scale"),
    Flag("v_scaled", False, _in("V_SCALED", _STORE), what="store: the v cache holds value / v_scale"),
    Flag("to_dst", False, _in("TO_DST", _REROTATE),
         what="re-rotation: rows written into dst_slots (the tail copied), sources untouched"),
    Flag("two_tables", False, _in("TWO_TABLES", _REROTATE),
         what="re-rotation: row i moves from cos_sin_cache[positions[i]] to to_cache[positions[i] + delta[i]] "
              "(one composed rotation)"),
    Flag("q_temperature", False, _in("Q_TEMPERATURE", _ROPE),
         what="q's outputs (rotated dims and kept tail) times log(floor((pos + 1) / floor_scale) + 1) * "
              "attn_scale + 1 of their token's position (Llama 4's attention temperature tuning); the two "
              "floats are Spec.q_temperature's, runtime arguments of the kernel"),
    Flag("fp4", False, _in("FP4", _STORE),
         what="store: NVFP4 caches, k_cache / v_cache uint8 e2m1 codes (two a byte) beside float8_e4m3fn "
              "block scales per 16 values (k_cache_scales / v_cache_scales); k_scale / v_scale the global scales"),
    Flag("head_table", False, _in("HEAD_TABLE", _ROPE),
         what="the table holds a [cos | sin] row per (position, head), (max_position, Ht, rotary_dim) (FoPE): "
              "head j of a tensor of H heads reads table head j // (H / Ht); the kernel reads a row per head"),
    Flag("eager_rounding", False, _in("EAGER_ROUNDING", _ROPE), keyword="eager_rounding",
         refuses=(("norm_q", "norm_k"), "it rounds the rotation only"),
         what="the rotation rounds as eager PyTorch's q * cos + rotate_half(q) * sin does in q's dtype "
              "(cos / sin rounded to it, each product, then the sum): bit-identical to that expression; the "
              "backward likewise to eager autograd's"),
    Flag("axis_map", (), {}, coded=False,
         what="M-RoPE: the position row of each rotary pair (rotary_dim // 2 entries, mrope_axes), for "
              "every layout; () without M-RoPE (encoded after the sections)"),
)
# fmt: on

_Fields = collections.namedtuple("_Fields", [f.name for f in FLAGS], defaults=[f.default for f in FLAGS])


class Variant(_Fields):
    """Every flag of one call that a kernel, a plan or the CPU path branches on (its fields: FLAGS,
    in that order). Frozen and hashable: specs and plans are keyed by it."""

    __slots__ = ()

    def encode(self) -> List[int]:
        """The custom ops' encoding of this record (one int list: a schema cannot take a NamedTuple):
        every coded flag as an int in FLAGS' order, the angle source by its index in ANGLE_SOURCES,
        then the number of sections, the sections and the axis map. The view flags (heads_first,
        seq_first, rope_last) are left out: the ops take tokens-first views of the rotated part."""
        coded = [_code(f, getattr(self, f)) for f in _CODED]
        return coded + [len(self.sections), *self.sections, *self.axis_map]

    @staticmethod
    def decode(codes: Sequence[int]) -> "Variant":
        """The record `encode` made (tokens first)."""
        n = len(_CODED)
        fields = {f: _field(f, c) for f, c in zip(_CODED, codes[:n])}
        n_sec = int(codes[n])
        sections = tuple(int(c) for c in codes[n + 1 : n + 1 + n_sec])
        return Variant(sections=sections, axis_map=tuple(int(c) for c in codes[n + 1 + n_sec :]), **fields)

    def pair_rows(self) -> Optional[Tuple[int, ...]]:
        """M-RoPE's axis map (None without M-RoPE): axis_map, or for a record built without one,
        the map of its Qwen2-VL / Qwen3-VL mode from the sections."""
        if not self.mrope:
            return None
        if self.axis_map:
            return self.axis_map
        return mrope_axes("interleaved" if self.mrope == MROPE_INTERLEAVED else "chunked", self.sections)

    @property
    def normed(self) -> bool:
        """Is q or k normalized before the rotation?"""
        return self.norm_q != 0 or self.norm_k != 0

    def tokens_first(self) -> "Variant":
        """This variant for the views the rotation's custom ops take: tokens first, the rotated part
        alone (apply_rope's no-rope parts given apart are joined to it in ops.py)."""
        return self._replace(heads_first=False, seq_first=False, rope_last=False, nope_q=False, nope_k=False)

    def unscaled(self) -> "Variant":
        """This variant writing unscaled values (the CPU path rotates into float32, then scales)."""
        return self._replace(scaled=False)

    def float_caches(self) -> "Variant":
        """This store variant writing float32 caches as given (the CPU path of NVFP4 caches stores
        rows first, then quantizes them): no fp4, no cache scales."""
        return self._replace(fp4=False, k_scaled=False, v_scaled=False)

    def whole_heads(self) -> "Variant":
        """This variant for heads given whole: no no-rope parts apart (the CPU path joins them)."""
        return self._replace(nope_q=False, nope_k=False)

    def backward(self) -> "Variant":
        """The rotation that maps output gradients to input gradients, by each flag's backward rule
        in FLAGS: the inverse, reading the output layout and writing the input layout."""
        changed = {}
        for f in FLAGS:
            if f.backward == "negate":
                changed[f.name] = not getattr(self, f.name)
            elif f.backward.startswith("from "):
                changed[f.name] = getattr(self, f.backward[5:])
        return self._replace(**changed)


def mrope_axes(layout, sections: Sequence[int]) -> Tuple[int, ...]:
    """M-RoPE's axis map: for each rotary pair j (sum(sections) of them) the position row that
    drives it, for a preset layout name (MROPE_LAYOUTS) or an explicit map (returned as a tuple).
    Validated arguments only (ropekit.core.rules.mrope_args checks the presets' conditions).

        chunked      pairs in section order: sections[0] pairs of row 0, then sections[1] of row 1, ...
                     (Qwen2-VL's mrope_section)
        interleaved  pair j takes row a = j % N while a > 0 and j < N * sections[a], else row 0
                     (Qwen3-VL's interleaved mrope_section, N = 3)
        ernie        sections (s_1, ..., s_{N-1}, t), the s_a equal: the first (N-1) * s_1 pairs cycle
                     through rows 1 .. N-1, the last t pairs take row 0 (ERNIE 4.5-VL's (h, w, t):
                     h w h w ... t t t; vLLM rotary_embedding/ernie45_vl_rope.py,
                     Ernie4_5_VLRotaryEmbedding.forward_native)
        bailing      sections (t, s_1, ..., s_{N-1}), the s_a equal: the same order, rows cycling
                     over the first sum(s_a) pairs, the t tail last (vLLM rotary_embedding/
                     bailing_mrope.py, BailingMRotaryEmbedding.select_cos_sin)
        pangu        rows spread evenly: each pair takes, of the rows with pairs left and (while
                     another has some) other than the previous pair's, the one least used so far
                     relative to its count (ties: the lower row); with N >= 3 the last pair is row 0's
                     (its count one less while spreading) (vLLM rotary_embedding/
                     mrope_interleaved.py, MRotaryEmbeddingInterleaved.get_mrope_interleaved_id_list)
    """
    sections = [int(v) for v in sections]
    n, half = len(sections), sum(sections)
    if not isinstance(layout, str):
        return tuple(int(a) for a in layout)
    if layout == "chunked":
        return tuple(a for a, count in enumerate(sections) for _ in range(count))
    if layout == "interleaved":
        return tuple((j % n) if (j % n and j < n * sections[j % n]) else 0 for j in range(half))
    if layout in ("ernie", "bailing"):
        spatial = sum(sections[:-1]) if layout == "ernie" else sum(sections[1:])
        return tuple(1 + j % (n - 1) if j < spatial else 0 for j in range(half))
    # pangu: the greedy spread, row 0's last pair held back with three rows or more
    counts = list(sections)
    hold = n >= 3
    counts[0] -= hold
    used, left, out, last = [0] * n, list(counts), [], None
    for _ in range(sum(counts)):
        rows = [a for a in range(n) if left[a] > 0 and a != last] or [a for a in range(n) if left[a] > 0]
        best = min(rows, key=lambda a: (used[a] / counts[a], a))
        out.append(best)
        used[best] += 1
        left[best] -= 1
        last = best
    return tuple(out + [0] * hold)


def mrope_mode(sections: Sequence[int], axis_map: Sequence[int]) -> int:
    """Variant.mrope for an axis map: Qwen2-VL's or Qwen3-VL's three-row layouts when it is one of
    them (the kernels compute those from the sections), else MROPE_MAP."""
    if len(sections) == 3:
        for mode, name in ((MROPE_CHUNKED, "chunked"), (MROPE_INTERLEAVED, "interleaved")):
            if tuple(axis_map) == mrope_axes(name, sections):
                return mode
    return MROPE_MAP


# the coded flags in the custom-op encoding's order, and each one's value <-> int
_CODED = tuple(f.name for f in FLAGS if f.coded)


def _code(field: str, value) -> int:
    return ANGLE_SOURCES.index(value) if field == "angles" else int(value)


def _field(field: str, code: int):
    if field == "angles":
        return ANGLE_SOURCES[code]
    return type(Variant._field_defaults[field])(code)


class Spec:
    """What validation concluded about one call signature, and its plans once made."""

    __slots__ = (
        "variant",
        "rot",
        "door",
        "triton",
        "extents",
        "angle_shape",
        "angle_strides",
        "copy_angles",
        "packed",
        "plans",
        "alias",
        "inplace",
        "out_dtype",
        "twin",
        "alone",
        "table",
        "norm_eps",
        "norm_offset",
        "q_temperature",
        "strided",
        "settled",
        "normed",
        "views",
        "plan",
        "record",
    )

    def __init__(
        self,
        variant: Variant,
        rot: int,
        door: str,
        triton: bool,
        *,
        extents=(),
        angle_shape=None,
        angle_strides=None,
        copy_angles=False,
        packed=(1, 0),
        inplace=False,
        out_dtype=None,
        norm_eps=0.0,
        norm_offset=0.0,
        q_temperature=(1.0, 0.0),
        strided=False,
        settled=True,
    ):
        self.variant = variant
        self.rot = rot  # rotated dims
        self.door = door
        self.triton = triton  # the Triton kernel runs (CUDA, or the interpreter on CPU)
        self.extents = extents  # bytes spanned by the call's tensors (cheap overlap tests)
        self.angle_shape = angle_shape  # per-token angles: the shape cos / sin broadcast to;
        #                                 table angles: the shape positions expand to (None: as given)
        self.angle_strides = angle_strides  # per-token angles: the kernel's (sec, b, s, col) strides
        self.copy_angles = copy_angles  # per-token angles whose strides differ: copied per call
        self.packed = packed  # packed angles: (cp_size, cp_rank)
        self.plans: dict = {}  # launch plans by (variant, output / gradient layouts)
        self.alias: dict = {}  # the store's aliasing verdicts by byte distance
        self.table = None  # a weak reference to the last [cos | sin] table whose values were read
        self.inplace = inplace  # the rotation writes into q and k (autograd: marked dirty)
        self.out_dtype = out_dtype  # dtype of fresh outputs (None: the input's)
        self.twin = None  # an in-place spec's out-of-place twin (its backward writes fresh tensors)
        self.alone = None  # specs for q alone and k alone (in-place views under autograd)
        self.norm_eps = norm_eps  # with variant.normed: RMSNorm's epsilon
        self.norm_offset = norm_offset  # ... and the offset added to its weights (Gemma's 1.0)
        self.q_temperature = q_temperature  # with variant.q_temperature: (floor_scale, attn_scale)
        # q or k has a last stride other than 1: the kernel reads it through its strides (in place
        # writes back through them); out of place the views give it contiguous outputs (ops.py)
        self.strided = strided
        self.settled = settled  # False: a verdict from values that could not decide (not memoized)
        self.normed = variant.normed  # read on every call: an attribute, not the property
        # apply_rope's view forms: the door sees views made per call (ops.py, `_views`)
        self.views = strided or variant.seq_first or variant.rope_last or variant.nope_q or variant.nope_k
        self.plan = None  # the rotation's forward launch plan once made (False: nothing to launch)
        self.record = None  # its direct launch record (pipeline.rotate_record; False: none serves)

    def _copy(self, inplace: bool) -> "Spec":
        twin = Spec(self.variant, self.rot, self.door, self.triton)
        for name in self.__slots__:
            if name not in ("plans", "alias", "twin", "alone", "table", "normed", "views", "plan"):
                setattr(twin, name, getattr(self, name))
        twin.inplace = inplace
        return twin

    def out_of_place(self) -> "Spec":
        """This spec, or for an in-place one its out-of-place twin (made once)."""
        if not self.inplace:
            return self
        if self.twin is None:
            self.twin = self._copy(False)
        return self.twin

    def split(self) -> tuple:
        """Two specs like this one, for q alone and for k alone (each keeps its own launch plans)."""
        if self.alone is None:
            self.alone = (self._copy(self.inplace), self._copy(self.inplace))
        return self.alone


# ---------------------------------------------------------------------------------------------
# the one signature key


_Tensor = torch.Tensor
_SCALARS = frozenset((bool, int, float, str, torch.dtype))


def arg_key(x):
    """One argument's part of a signature key: a tensor's (type, shape, strides, dtype, device,
    requires_grad), another value with its type (16 and 16.0 hash alike but validate differently);
    sequences element by element."""
    t = type(x)
    if t in _SCALARS:
        return t, x
    if x is None:
        return None
    # the exact type before isinstance: isinstance against torch.Tensor goes through its metaclass
    if t is _Tensor or isinstance(x, _Tensor):
        return (t, x.shape, x.stride(), x.dtype, x.device, x.requires_grad)
    return value_key(x)


class Signature(NamedTuple):
    """An op's parameters as ropekit.core.pipeline.prepare reads them (from the function's own
    signature): the op passes its positional arguments and its keyword-only ones as two tuples in
    signature order, and the names rebuild the arguments by name for validation."""

    op: str
    names: tuple  # every parameter, in signature order
    defaults: tuple  # the keyword-only parameters' defaults (one identity test each while unchanged)
    recent: list  # the op's recent signatures, newest first (ropekit.core.pipeline.prepare's entries)
    indices: range  # the keyword-only parameters' indices (the changed ones are picked from it)
    exact: list  # those of the recent signatures whose keywords are tested in one exact pass (prepare)

    @staticmethod
    def of(fn, op: str = "") -> "Signature":
        params = list(inspect.signature(fn).parameters.values())
        defaults = tuple(p.default for p in params if p.kind is p.KEYWORD_ONLY)
        recent, exact = remembered([]), remembered([])  # emptied with the memo
        names = tuple(p.name for p in params)
        return Signature(op or fn.__name__, names, defaults, recent, range(len(defaults)), exact)

    def arguments(self, leading: tuple, keywords: tuple) -> dict:
        """The call's arguments by name (what the op's validation reads)."""
        return dict(zip(self.names, leading + keywords))
