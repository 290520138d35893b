"""The rotary helper forms of diffusers' transformers, as `seams.Form`s (ropekit.diffusers tries
each module-level helper against the forms of its arity and patches it on the first that agrees).

| form | helper (diffusers 0.42) | angles | x |
|---|---|---|---|
| shared | embeddings.apply_rotary_emb(x, freqs_cis, use_real, use_real_unbind_dim, sequence_dim) | pairs (unbind -1), halves (-2), complex (use_real=False, (B, S, D/2); complex128 too: Lumina 2) | (B, H, S, D) sequence_dim 2, (B, S, H, D) 1 |
| qwen | apply_rotary_emb_qwen(x, freqs_cis, use_real, use_real_unbind_dim) | complex (S, D/2); real as shared with sequence_dim 2 | (B, S, H, D) |
| pairs_x / halves_x | LTX's apply_rotary_emb(x, freqs), LongCat-Audio's _apply_rotary_emb(x, rope) | (cos, sin) pairs / halves | (B, S, C) flat with (B, S, C) angles, or (B, S, H, D) with (S, D) or (B, S, D) |
| split_x | LTX-2's / Sana-WM refiner's apply_split_rotary_emb(x, (cos, sin)) | halves (B, H, S, D/2) per head, or (B, S, C/2) flat | (B, S, H * D) or (B, H, S, D); (B, S, C) |
| angles_x | Stable Audio 3's _apply_rotary_partial(x, freqs) | the angles themselves, halves (S_max, R), the last S rows, R <= D (partial) | (B, S, H, D) |
| complex_dt | Sana-WM's _apply_rotary_emb(x, freqs) | complex (1 or B, 1, S, D/2) | (B, H, D, S), a view of (B, S, H, D) |
| halves_cs | MiniMax's _apply_rotary_emb(x, cos, sin) | halves (S, R), R <= D (partial) | (B, S, H, D) |
| matrix | PRX's apply_rope(x, freqs_cis), Kandinsky 6's apply_rotary(x, rope) | (.., D/2, 2, 2) rotation matrices | (B, S, H, D) or (B, H, S, D) |
| complex_x | complex64 freqs (S, 1, D/2) or (B, S, 1, D/2) against x directly | complex | (B, S, H, D) |
| cat_x | Helios' apply_rotary_emb_transposed(x, freqs_cis) | cat(cos, sin) (B, S, 2D), pairs | (B, S, H, D) |
| axes3 | Allegro's apply_rotary_emb_allegro(x, freqs_cis, positions) | three (cos, sin) halves tables (L, D/3), one per third of D, rows gathered by (1 or B, S) positions | (B, H, S, D) |
| grid | Wan-Animate 2's rope_apply(x, grid_sizes, freqs, time_stride) | complex (L, D/2) table split in (t, h, w) columns, per-sample (f, h, w) grid of the leading f h w tokens (the rest kept), frames times time_stride; float32 result | (B, S, H, D) |
| *_qk | the same with (q, k, freqs) returning (q, k): HiDream's apply_rope, JoyImage's _apply_rotary_emb, JoyImage-Edit+'s _apply_rotary_emb_batched | as above | as above |
"""

from __future__ import annotations

from typing import Callable, Dict, Tuple

import torch

from . import rotations as R
from .seams import Form

B, S, H, D = 2, 5, 3, 8  # verification sizes


def _theta(gen, *shape):
    return torch.randn(*shape, generator=gen) * 3


def _x(gen, *shape):
    return torch.randn(*shape, generator=gen)


def _pairs(theta):
    return theta.cos().repeat_interleave(2, -1), theta.sin().repeat_interleave(2, -1)


def _halves(theta):
    return torch.cat((theta.cos(),) * 2, -1), torch.cat((theta.sin(),) * 2, -1)


def _real(x, freqs, unbind, heads_first):
    if not isinstance(freqs, (tuple, list)) or len(freqs) != 2 or unbind not in (-1, -2):
        return None
    cos, sin = freqs
    if not R.takes(x, cos, sin) or x.dim() != 4 or cos.dim() != 2:
        return None
    cs = (R.pairs if unbind == -1 else R.halves)(cos, sin, x.shape[-1])
    return None if cs is None else R.rotate(x, *cs, interleaved=unbind == -1, heads_first=heads_first)


def _dtype(t):
    """A complex freqs' dtype, part of a convention key: complex128 (Lumina 2's tables) is verified
    on its own, so a helper that keeps float64 for it is not given ropekit's x-dtype result."""
    return str(t.dtype).replace("torch.", "") if isinstance(t, torch.Tensor) else None


def _complex(x, freqs, ndim):
    if not R.takes(x, freqs) or x.dim() != 4 or freqs.dim() != ndim:
        return None
    cs = R.complex_parts(freqs)
    if cs is None or cs[0].shape[-1] != x.shape[-1] // 2:
        return None
    return R.rotate(x, *cs, interleaved=True)


# --- shared: diffusers.models.embeddings.apply_rotary_emb


def _shared_key(a):
    return (True, a["unbind"], a["seq"]) if a["use_real"] else (False, _dtype(a["freqs"]))


def _shared(a):
    if a["use_real"]:
        return None if a["seq"] not in (1, 2) else _real(a["x"], a["freqs"], a["unbind"], a["seq"] == 2)
    return _complex(a["x"], a["freqs"], 3)


def _shared_samples(gen):
    out = []
    for unbind, angles in ((-1, _pairs), (-2, _halves)):
        for seq, shape in ((1, (B, S, H, D)), (2, (B, H, S, D))):
            out.append(((_x(gen, *shape), angles(_theta(gen, S, D // 2)), True, unbind, seq), (True, unbind, seq)))
    for dtype in (torch.float32, torch.float64):  # complex64, complex128
        fc = torch.polar(torch.ones(B, S, D // 2, dtype=dtype), _theta(gen, B, S, D // 2).to(dtype))
        out.append(((_x(gen, B, S, H, D), fc, False, -1, 1), (False, _dtype(fc))))
    return out


# --- qwen: apply_rotary_emb_qwen (complex freqs (S, D/2); its real path reads (B, H, S, D))


def _qwen_key(a):
    return ("real", a["unbind"]) if a["use_real"] else (False, _dtype(a["freqs"]))


def _qwen(a):
    return _real(a["x"], a["freqs"], a["unbind"], True) if a["use_real"] else _complex(a["x"], a["freqs"], 2)


def _qwen_samples(gen):
    fc = torch.polar(torch.ones(S, D // 2), _theta(gen, S, D // 2))
    out = [((_x(gen, B, S, H, D), fc, False, -1), (False, _dtype(fc)))]
    for unbind, angles in ((-1, _pairs), (-2, _halves)):
        out.append(((_x(gen, B, H, S, D), angles(_theta(gen, S, D // 2)), True, unbind), ("real", unbind)))
    return out


# --- (x, (cos, sin)): pairs or halves; flat (B, S, C) with (B, S, C) angles, or (B, S, H, D) with (S, D)


def _tuple_x(reader, interleaved):
    def rotate(a):
        x, freqs = a["x"], a["freqs"]
        if not isinstance(freqs, (tuple, list)) or len(freqs) != 2 or not R.takes(x, *freqs):
            return None
        cos, sin = freqs
        if cos.dim() not in ((3,) if x.dim() == 3 else (2, 3)):
            return None
        cs = reader(cos, sin, x.shape[-1])
        if cs is None:
            return None
        if x.dim() == 3:
            return R.rotate_flat(x, *cs, interleaved=interleaved)
        return R.rotate(x, *cs, interleaved=interleaved)

    return rotate


def _tuple_x_samples(angles):
    def samples(gen):
        flat = (_x(gen, B, S, H * D), angles(_theta(gen, B, S, H * D // 2)))
        heads = (_x(gen, B, S, H, D), angles(_theta(gen, S, D // 2)))
        batched = (_x(gen, B, S, H, D), angles(_theta(gen, B, S, D // 2)))
        return [(flat, (3, 3)), (heads, (4, 2)), (batched, (4, 3))]

    return samples


def _x_dim(a):
    """(x dims, angle dims): the layouts a helper may take or not."""
    x, freqs = a["x"], a["freqs"]
    if not isinstance(x, torch.Tensor) or not isinstance(freqs, (tuple, list)) or not freqs:
        return None
    return (x.dim(), getattr(freqs[0], "ndim", None))


# --- (x, (cos, sin)) split halves: per-head (B, H, S, D/2) angles with (B, S, H * D) or (B, H, S, D)
# x, or flat (B, S, C/2) angles with (B, S, C) x


def _split_x(a):
    x, freqs = a["x"], a["freqs"]
    if not isinstance(freqs, (tuple, list)) or len(freqs) != 2 or not R.takes(x, *freqs):
        return None
    cos, sin = freqs
    if cos.shape != sin.shape or x.shape[-1] % 2:
        return None
    if cos.dim() == 3 and x.dim() == 3 and cos.shape[-1] * 2 == x.shape[-1]:
        return R.rotate_flat(x, cos, sin, interleaved=False)
    if cos.dim() != 4:
        return None
    b, h, t, r = cos.shape
    if x.dim() == 3 and x.shape[-1] == h * 2 * r:
        heads = x.unflatten(-1, (h, 2 * r)).transpose(1, 2)
    elif x.dim() == 4 and x.shape == (b, h, t, 2 * r):
        heads = x
    else:
        return None
    out = R.rotate_heads(heads, cos, sin, interleaved=False)
    return out.transpose(1, 2).flatten(2) if x.dim() == 3 and out is not None else out


def _split_x_samples(gen):
    theta = _theta(gen, B, H, S, D // 2)
    cs = (theta.cos(), theta.sin())
    flat = _theta(gen, B, S, H * D // 2)
    return [
        ((_x(gen, B, S, H * D), cs), (3, 4)),
        ((_x(gen, B, H, S, D), cs), (4, 4)),
        ((_x(gen, B, S, H * D), (flat.cos(), flat.sin())), (3, 3)),
    ]


# --- (x, angles (S_max, R) as [f, f]): the last S rows, the leading R dims rotated (partial)


def _angles_x(a):
    x, freqs = a["x"], a["freqs"]
    if not R.takes(x, freqs) or x.dim() != 4 or freqs.dim() != 2 or freqs.is_complex():
        return None
    n, r = x.shape[1], freqs.shape[-1]
    if freqs.shape[0] < n or r > x.shape[-1] or r % 2:
        return None
    theta = freqs[-n:, : r // 2].float()
    return R.rotate(x, theta.cos(), theta.sin(), interleaved=False)


def _angles_x_samples(gen):
    full = _theta(gen, S + 2, D // 2)
    partial = _theta(gen, S + 2, D // 4)
    return [((_x(gen, B, S, H, D), torch.cat((t, t), -1)), ()) for t in (full, partial)]


# --- (x (B, H, D, S), complex freqs (1 or B, 1, S, D/2)): x a view of (B, S, H, D)


def _complex_dt(a):
    x, freqs = a["x"], a["freqs"]
    if not isinstance(x, torch.Tensor) or x.dim() != 4 or not isinstance(freqs, torch.Tensor) or freqs.dim() != 4:
        return None
    if freqs.shape[1] != 1:
        return None
    tokens = x.permute(0, 3, 1, 2)
    out = _complex(tokens, freqs[:, 0], 3)
    return None if out is None else out.permute(0, 2, 3, 1)


def _complex_dt_samples(gen):
    out = []
    for lead in (1, B):
        freqs = torch.polar(torch.ones(lead, 1, S, D // 2), _theta(gen, lead, 1, S, D // 2))
        out.append(((_x(gen, B, S, H, D).permute(0, 2, 3, 1), freqs), (lead == 1, _dtype(freqs))))
    return out


def _lead_one(a):
    freqs = a["freqs"]
    return (freqs.shape[0] == 1, _dtype(freqs)) if isinstance(freqs, torch.Tensor) and freqs.dim() == 4 else None


# --- (x, cos, sin): halves, partial rotary (the leading R dims), (B, S, H, D) with (S, R)


def _halves_cs(a):
    x, cos, sin = a["x"], a["cos"], a["sin"]
    if not R.takes(x, cos, sin) or x.dim() != 4 or cos.dim() != 2 or cos.shape[-1] > x.shape[-1]:
        return None
    cs = R.halves(cos, sin, cos.shape[-1])
    return None if cs is None else R.rotate(x, *cs, interleaved=False)


def _halves_cs_samples(gen):
    full = (_x(gen, B, S, H, D), *_halves(_theta(gen, S, D // 2)))
    partial = (_x(gen, B, S, H, D), *_halves(_theta(gen, S, D // 4)))
    return [(full, ()), (partial, ())]


# --- (x, rotation matrices (..., D/2, 2, 2))


def _matrix(a):
    x, freqs = a["x"], a["freqs"]
    if not R.takes(x, freqs) or freqs.is_complex():
        return None
    found = R.matrix(freqs, x)
    if found is None:
        return None
    (cos, sin), heads_first = found
    return R.rotate(x, cos, sin, interleaved=True, heads_first=heads_first)


def _rot_matrix(theta):
    c, s = theta.cos(), theta.sin()
    return torch.stack((c, -s, s, c), -1).unflatten(-1, (2, 2))


def _matrix_samples(gen):
    tokens = (_x(gen, B, S, H, D), _rot_matrix(_theta(gen, B, S, 1, D // 2)))
    heads = (_x(gen, B, H, S, D), _rot_matrix(_theta(gen, B, 1, S, D // 2)))
    return [(tokens, ()), (heads, ())]


# --- (x, complex freqs with a size-1 head dim), against x directly


def _complex_x(a):
    x, freqs = a["x"], a["freqs"]
    if not isinstance(freqs, torch.Tensor) or freqs.dim() not in (3, 4) or freqs.shape[-2] != 1:
        return None
    return _complex(x, freqs.squeeze(-2), freqs.dim() - 1)


def _complex_x_samples(gen):
    per_seq = torch.polar(torch.ones(S, 1, D // 2), _theta(gen, S, 1, D // 2))
    per_batch = torch.polar(torch.ones(B, S, 1, D // 2), _theta(gen, B, S, 1, D // 2))
    return [((_x(gen, B, S, H, D), f), (f.dim(), _dtype(f))) for f in (per_seq, per_batch)]


def _freqs_dim(a):
    return (a["freqs"].dim(), _dtype(a["freqs"])) if isinstance(a["freqs"], torch.Tensor) else None


# --- (x, cat(cos, sin) (B, S, 2D)), pairs


def _cat_x(a):
    x, freqs = a["x"], a["freqs"]
    if not R.takes(x, freqs) or x.dim() != 4 or freqs.dim() != 3 or freqs.shape[-1] != 2 * x.shape[-1]:
        return None
    cos, sin = freqs.chunk(2, dim=-1)
    return R.rotate(x, *R.pairs(cos, sin, x.shape[-1]), interleaved=True)


def _cat_x_samples(gen):
    return [((_x(gen, B, S, H, D), torch.cat(_pairs(_theta(gen, B, S, D // 2)), -1)), ())]


# --- (x, ((cos, sin) x 3), positions x 3): each third of D rotated as halves by its own axis's table


def _axes3(a):
    x, freqs, pos = a["x"], a["freqs"], a["positions"]
    if not isinstance(freqs, (tuple, list)) or len(freqs) != 3 or not R.takes(x):
        return None
    if not isinstance(pos, (tuple, list, torch.Tensor)) or len(pos) != 3:
        return None
    if x.dim() != 4 or x.shape[-1] % 6:
        return None
    c = x.shape[-1] // 3
    out = []
    for i, (table, p) in enumerate(zip(freqs, pos)):
        if not isinstance(table, (tuple, list)) or len(table) != 2 or not R.takes(x, *table):
            return None
        cos, sin = table
        if not isinstance(p, torch.Tensor) or p.dtype not in (torch.int32, torch.int64) or p.dim() != 2:
            return None
        if cos.dim() != 2 or p.shape[0] not in (1, x.shape[0]) or p.shape[1] != x.shape[2]:
            return None
        cs = R.halves(cos, sin, c)
        if cs is None:
            return None
        rows = (torch.nn.functional.embedding(p, t) for t in cs)
        out.append(R.rotate(x[..., i * c : (i + 1) * c], *rows, interleaved=False, heads_first=True))
    return torch.cat(out, -1)


def _axes3_samples(gen):
    c, n = 4, S + 3  # 12 dims per head: 4 per axis
    x = _x(gen, B, H, S, 3 * c)
    tables = tuple(_halves(_theta(gen, n, c // 2)) for _ in range(3))
    out = []
    for lead in (1, B):
        pos = tuple(torch.randint(0, n, (lead, S), generator=gen) for _ in range(3))
        out.append(((x, tables, pos), ()))
    return out


# --- (x, grid_sizes (B, 3), complex freqs (L, D/2), time_stride): per-sample (f, h, w) grids


def _grid_angles(grid, freqs, d, n, stride):
    """(cos, sin) (B, n, d / 2) float32 of each sample's f h w leading tokens (the rest identity),
    or None when the table or the sequence is too short (the helper raises its own error)."""
    c = d // 2
    t_f, h_f, w_f = freqs.split([c - 2 * (c // 3), c // 3, c // 3], dim=1)
    parts = torch.view_as_real(freqs)
    cos, sin = parts.new_ones(len(grid), n, c), parts.new_zeros(len(grid), n, c)
    for i, (f, h, w) in enumerate(grid.tolist()):
        if f * h * w > n or (f - 1) * stride >= len(t_f) or h > len(h_f) or w > len(w_f) or min(f, h, w) < 1:
            return None
        angles = torch.cat(
            [
                t_f[: f * stride : stride].view(f, 1, 1, -1).expand(f, h, w, -1),
                h_f[:h].view(1, h, 1, -1).expand(f, h, w, -1),
                w_f[:w].view(1, 1, w, -1).expand(f, h, w, -1),
            ],
            -1,
        ).reshape(f * h * w, c)
        cos[i, : f * h * w], sin[i, : f * h * w] = angles.real, angles.imag
    return cos.float(), sin.float()


def _grid(a):
    x, grid, freqs, stride = a["x"], a["grid"], a["freqs"], a["stride"]
    if not R.takes(x) or x.dim() != 4 or x.shape[-1] % 2 or not isinstance(stride, int) or stride < 1:
        return None
    if (
        not isinstance(grid, torch.Tensor)
        or grid.dtype not in (torch.int32, torch.int64)
        or grid.shape != (x.shape[0], 3)
    ):
        return None
    if not isinstance(freqs, torch.Tensor) or freqs.dtype not in (torch.complex64, torch.complex128):
        return None
    if freqs.dim() != 2 or freqs.shape[1] != x.shape[-1] // 2 or freqs.requires_grad:
        return None
    cs = _grid_angles(grid, freqs, x.shape[-1], x.shape[1], stride)
    return None if cs is None else R.rotate(x.float(), *cs, interleaved=True)


def _grid_samples(gen):
    d, n = 12, S + 1  # (t, h, w) columns (2, 2, 2)
    freqs = torch.polar(torch.ones(8, d // 2, dtype=torch.float64), _theta(gen, 8, d // 2).double())
    grids = torch.tensor([[2, 1, 3], [1, 2, 2]])
    return [((_x(gen, B, n, H, d), grids, freqs, stride), ()) for stride in (1, 2)]


# --- (q, k, freqs) -> (q, k): a single-x form applied to both


def _qk(rotate: Callable, samples: Callable):
    def rotate_qk(a):
        q = rotate({"x": a["q"], "freqs": a["freqs"]})
        k = rotate({"x": a["k"], "freqs": a["freqs"]})
        return None if q is None or k is None else (q, k)

    def samples_qk(gen):
        return [((x, x.flip(0), freqs), key) for (x, freqs), key in samples(gen)]

    return rotate_qk, samples_qk


def _none(a):
    return ()


_X = ("x", "freqs")
_QK = ("q", "k", "freqs")
_matrix_qk = _qk(_matrix, _matrix_samples)
_pairs_qk = _qk(_tuple_x(R.pairs, True), _tuple_x_samples(_pairs))


def _qk_key(key_fn):
    return lambda a: key_fn({"x": a["q"], "freqs": a["freqs"]})


FORMS: Tuple[Form, ...] = (
    Form("shared", ("x", "freqs", "use_real", "unbind", "seq"), _shared_key, _shared, _shared_samples),
    Form("qwen", ("x", "freqs", "use_real", "unbind"), _qwen_key, _qwen, _qwen_samples),
    Form("pairs_x", _X, _x_dim, _tuple_x(R.pairs, True), _tuple_x_samples(_pairs)),
    Form("halves_x", _X, _x_dim, _tuple_x(R.halves, False), _tuple_x_samples(_halves)),
    Form("matrix", _X, _none, _matrix, _matrix_samples),
    Form("complex_x", _X, _freqs_dim, _complex_x, _complex_x_samples),
    Form("cat_x", _X, _none, _cat_x, _cat_x_samples),
    Form("split_x", _X, _x_dim, _split_x, _split_x_samples),
    Form("angles_x", _X, _none, _angles_x, _angles_x_samples),
    Form("complex_dt", _X, _lead_one, _complex_dt, _complex_dt_samples),
    Form("halves_cs", ("x", "cos", "sin"), _none, _halves_cs, _halves_cs_samples),
    Form("axes3", ("x", "freqs", "positions"), _none, _axes3, _axes3_samples),
    Form("grid", ("x", "grid", "freqs", "stride"), _none, _grid, _grid_samples),
    Form("matrix_qk", _QK, _none, *_matrix_qk),
    Form("pairs_qk", _QK, _qk_key(_x_dim), *_pairs_qk),
)

BY_ARITY: Dict[int, Tuple[Form, ...]] = {}
for _form in FORMS:
    BY_ARITY[len(_form.roles)] = BY_ARITY.get(len(_form.roles), ()) + (_form,)
