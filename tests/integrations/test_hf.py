"""Hugging Face drop-ins (ropekit.hf): function parity, model parity, patching.

- Every (family, function) in ropekit.hf.FAMILIES is compared with that family's own HF function
  run in float64 on the same values (HF's exact semantics, exact arithmetic): outputs, output
  dtypes, and gradients w.r.t. q and k, and the kernel path must actually have been taken.
- Tiny randomly initialised models of the required families (built from configs in code, no
  downloads), patched vs unpatched in float32: logits and every parameter gradient agree, and
  both agree with the unpatched model run in float64. A deliberately wrong rotation (the inverse
  angle) is shown to move the logits far outside the tolerance, so the parity check can fail.
- patch / unpatch / patched: what is patched, unknown families refused, originals restored.
"""

import copy
import importlib
import zlib
from unittest import mock

import pytest
import torch

transformers = pytest.importorskip("transformers")

from ropekit import hf  # noqa: E402
from ropekit.api import ops  # noqa: E402
from ropekit.integrations import hf_census  # noqa: E402

from helpers.hf_models import PARITY_LM  # noqa: E402


def tols(dtype, device):
    """|ropekit - float64 HF| <= atol + rtol * |ref|. float32: float32 arithmetic on O(1) values.
    bf16 / fp16: one rounding of the float32 result; to nearest on CUDA (half an ulp); the Triton
    interpreter truncates fp32 -> bf16, so on CPU up to a whole ulp (2^-7)."""
    if dtype == torch.float32:
        return dict(rtol=4e-6, atol=4e-6)
    if dtype == torch.float16:
        return dict(rtol=2**-11 * 1.01 * (1 if str(device).startswith("cuda") else 2), atol=1e-5)
    return dict(rtol=(2**-8 if str(device).startswith("cuda") else 2**-7) * 1.01, atol=1e-5)


def _module(family):
    return importlib.import_module(f"transformers.models.{family}.modeling_{family}")


def _original(family, attr):
    return hf._ORIGINALS.get((f"transformers.models.{family}.modeling_{family}", attr), getattr(_module(family), attr))


def _available(family):
    try:
        _module(family)
        return True
    except ImportError:
        return False


pytestmark = pytest.mark.usefixtures("hf_unpatched")  # transformers unpatched around every test


@pytest.fixture
def kernel_calls():
    """Counts calls that reach ropekit's op (the drop-ins' kernel path, not their fallback)."""
    with mock.patch.object(ops, "rotate_angles", wraps=ops.rotate_angles) as first:
        yield _Calls(first)


class _Calls:
    def __init__(self, *spies):
        self.spies = spies

    @property
    def call_count(self):
        return sum(spy.call_count for spy in self.spies)


# ---------------------------------------------------------------------------------------------
# function parity: every table entry against its own HF function in float64

PARTIAL = {"phi3", "gpt_neox", "qwen3_next", "glm", "glm4", "glm4_moe"}  # HF slices by cos width
PAIRS_TABLE = {"cohere", "cohere2"}  # cos is [f0, f0, f1, f1, ...]


def _hf_inputs(
    kind, *, dtype, device, gen, B=2, S=3, Hq=4, Hk=2, D=16, rot=None, ud=1, table_batch=None, table_dtype=None
):
    """q, k (HF layout, views of projections) and cos, sin (or freqs_cis) as HF builds them."""
    rot = D if rot is None else rot
    table_batch = B if table_batch is None else table_batch
    table_dtype = dtype if table_dtype is None else table_dtype

    def proj(H):
        x = torch.randn(B, S, H * D, generator=gen).to(device=device, dtype=dtype).view(B, S, H, D)
        return x.transpose(1, 2) if ud == 1 else x

    q, k = proj(Hq), proj(Hk)
    if kind == "llama4":
        q, k = q.transpose(1, 2) if ud == 1 else q, k.transpose(1, 2) if ud == 1 else k  # (B, S, H, D)
        ang = torch.rand(table_batch, S, D // 2, generator=gen, dtype=torch.float64) * 20
        scale = 1 + 0.1 * torch.rand(table_batch, S, D // 2, generator=gen, dtype=torch.float64)
        return q, k, torch.polar(scale, ang).to(torch.complex64).to(device)
    freqs = torch.rand(table_batch, S, rot // 2, generator=gen, dtype=torch.float64) * 20
    if kind == "mrope":
        freqs = torch.rand(3, table_batch, S, rot // 2, generator=gen, dtype=torch.float64) * 20
    emb = freqs.repeat_interleave(2, dim=-1) if kind == "pairs_table" else torch.cat((freqs, freqs), -1)
    scale = 1.0 + 0.25 * torch.rand((), generator=gen, dtype=torch.float64)  # attention factor
    cos = (emb.cos() * scale).to(device=device, dtype=table_dtype)
    sin = (emb.sin() * scale).to(device=device, dtype=table_dtype)
    return q, k, cos, sin


def _kind(family, attr):
    if attr == "apply_rotary_emb":
        return "llama4"
    if attr == "apply_multimodal_rotary_pos_emb":
        return "mrope"
    return "pairs_table" if family in PAIRS_TABLE else "plain"


def _run_both(dropin, original, args, extra=(), kwargs=None, upstream_seed=0):
    """Drop-in on args vs HF's original on float64 copies; returns (outs, ref outs, grads, ref grads)."""
    kwargs = kwargs or {}
    q, k = (a.detach().clone().requires_grad_() for a in args[:2])
    rest = args[2:]
    outs = dropin(q, k, *rest, *extra, **kwargs)
    g = torch.Generator().manual_seed(upstream_seed)
    ups = [torch.randn(o.shape, generator=g).to(device=o.device, dtype=o.dtype) for o in outs]
    grads = torch.autograd.grad(outs, (q, k), ups)

    def wide(t):
        return t.to(torch.complex128) if t.is_complex() else t.double()

    q64, k64 = (a.detach().double().requires_grad_() for a in args[:2])
    refs = original(q64, k64, *(wide(t) for t in rest), *extra, **kwargs)
    ref_grads = torch.autograd.grad(refs, (q64, k64), [u.double() for u in ups])
    return outs, refs, grads, ref_grads


def _assert_matches(outs, refs, grads, ref_grads, dtypes, device):
    for name, o, r, dt in zip(("q_embed", "k_embed"), outs, refs, dtypes):
        assert o.shape == r.shape, f"{name}: shape {tuple(o.shape)}, HF {tuple(r.shape)}"
        assert o.dtype == dt, f"{name}: dtype {o.dtype}, HF gives {dt}"
        torch.testing.assert_close(o.double(), r, **tols(o.dtype, device), msg=lambda m: f"{name}: {m}")
    for name, g, r in zip(("grad q", "grad k"), grads, ref_grads):
        torch.testing.assert_close(g.double(), r, **tols(g.dtype, device), msg=lambda m: f"{name}: {m}")


def _hf_out_dtypes(original, args, extra=()):
    with torch.no_grad():
        return [o.dtype for o in original(*args, *extra)]


TABLE = [(f, a) for f in sorted(hf.FAMILIES) for a in hf.FAMILIES[f] if a != "apply_multimodal_rotary_pos_emb"]


@pytest.mark.parametrize("family,attr", TABLE, ids=[f"{f}.{a}" for f, a in TABLE])
def test_every_table_entry_matches_its_hf_function(family, attr, kernel_calls):
    if not _available(family):
        pytest.skip(f"transformers {transformers.__version__} has no {family}")
    if not hasattr(_module(family), attr):
        pytest.skip(f"transformers {transformers.__version__}: {family} has no {attr}")
    original, dropin = _original(family, attr), hf.FAMILIES[family][attr]
    gen = torch.Generator().manual_seed(zlib.crc32(f"{family}.{attr}".encode()))
    rot = 8 if family in PARTIAL and attr == "apply_rotary_pos_emb" else None
    args = _hf_inputs(_kind(family, attr), dtype=torch.float32, device="cpu", gen=gen, rot=rot)
    res = _run_both(dropin, original, args)
    _assert_matches(*res, _hf_out_dtypes(original, args), "cpu")
    assert kernel_calls.call_count == 1, "the drop-in fell back instead of running ropekit's kernel"


# the variants, on one representative of each layout
VARIANTS = {
    "llama": ("llama", "apply_rotary_pos_emb", {}),
    "llama_ud2": ("llama", "apply_rotary_pos_emb", dict(ud=2)),
    "llama_table_batch1": ("llama", "apply_rotary_pos_emb", dict(table_batch=1)),
    "neox_partial": ("gpt_neox", "apply_rotary_pos_emb", dict(rot=4)),
    "phi3_partial_ud2": ("phi3", "apply_rotary_pos_emb", dict(rot=12, ud=2)),
    "glm_partial": ("glm", "apply_rotary_pos_emb", dict(rot=8)),
    "glm_full_batch1": ("glm", "apply_rotary_pos_emb", dict(table_batch=1)),
    "deepseek_interleave": ("deepseek_v3", "apply_rotary_pos_emb_interleave", {}),
    "deepseek_interleave_ud2": ("deepseek_v3", "apply_rotary_pos_emb_interleave", dict(ud=2, Hk=1)),
    "olmo2_fp32_table": ("olmo2", "apply_rotary_pos_emb", dict(table_dtype=torch.float32)),
    "cohere": ("cohere", "apply_rotary_pos_emb", {}),
    "llama4": ("llama4", "apply_rotary_emb", {}),
    "llama4_batch1": ("llama4", "apply_rotary_emb", dict(table_batch=1)),
}


def _variant_case(name, dtype, device, kernel_calls):
    family, attr, kw = VARIANTS[name]
    if not _available(family) or not hasattr(_module(family), attr):
        pytest.skip(f"transformers {transformers.__version__} has no {family}.{attr}")
    original, dropin = _original(family, attr), hf.FAMILIES[family][attr]
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    args = _hf_inputs(_kind(family, attr), dtype=dtype, device=device, gen=gen, **kw)
    kwargs = dict(unsqueeze_dim=2) if kw.get("ud") == 2 and attr != "apply_rotary_emb" else {}
    res = _run_both(dropin, original, args, kwargs=kwargs)
    with torch.no_grad():
        dts = [o.dtype for o in original(*args, **kwargs)]
    _assert_matches(*res, dts, device)
    assert kernel_calls.call_count == 1, "the drop-in fell back instead of running ropekit's kernel"
    if kwargs:
        # transformers 5.x dropped position_ids: a 5th positional int is unsqueeze_dim
        with torch.no_grad():
            outs = dropin(*args, 2)
        torch.testing.assert_close(outs[0], res[0][0].detach(), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(VARIANTS))
def test_dropin_variants(name, dtype, kernel_calls):
    _variant_case(name, dtype, "cpu", kernel_calls)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("name", list(VARIANTS))
def test_dropin_variants_cuda(name, dtype, kernel_calls):
    _variant_case(name, dtype, "cuda", kernel_calls)


def _oracle_multimodal_4x(q, k, cos, sin, mrope_section, unsqueeze_dim=1):
    """transformers 4.x Qwen2-VL semantics, restated per frequency: frequency i (and its mirror
    i + D/2) reads row 0 for i < t, row 1 for t <= i < t + h, row 2 after."""
    t, h, _ = mrope_section
    half = cos.shape[-1] // 2
    i = torch.arange(half)
    row = (i >= t).long() + (i >= t + h).long()
    row = torch.cat((row, row)).to(cos.device)
    pick = row.view(1, *([1] * (cos.dim() - 2)), -1).expand(1, *cos.shape[1:])
    c = cos.gather(0, pick)[0].unsqueeze(unsqueeze_dim)
    s = sin.gather(0, pick)[0].unsqueeze(unsqueeze_dim)

    def one(x):
        x1, x2 = x[..., :half], x[..., half:]
        return x * c + torch.cat((-x2, x1), dim=-1) * s

    return one(q), one(k)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("ud,table_batch", [(1, None), (2, 1)])
def test_multimodal_rotary_pos_emb_4x(ud, table_batch, dtype, device, kernel_calls):
    gen = torch.Generator().manual_seed(11)
    D = 16
    args = _hf_inputs("mrope", dtype=dtype, device=device, gen=gen, D=D, ud=ud, table_batch=table_batch)
    section = [2, 3, 3]  # t + h + w = D / 2
    res = _run_both(hf.apply_multimodal_rotary_pos_emb, _oracle_multimodal_4x, args, extra=(section, ud))
    _assert_matches(*res, [dtype, dtype], device)
    assert kernel_calls.call_count == 1
    # and HF 4.x's own formula (the fallback's) agrees with the oracle in float64
    q, k, cos, sin = (a.double() for a in args)
    for a, b in zip(hf._math_mrope(q, k, cos, sin, section, ud), _oracle_multimodal_4x(q, k, cos, sin, section, ud)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("case", ["table_requires_grad", "float64", "wider_table_dtype", "odd_layout"])
def test_fallback_keeps_hf_semantics(case, kernel_calls):
    """Inputs the kernel does not take run HF's math (and say so by not reaching the kernel)."""
    gen = torch.Generator().manual_seed(12)
    original = _original("llama", "apply_rotary_pos_emb")
    q, k, cos, sin = _hf_inputs("plain", dtype=torch.float32, device="cpu", gen=gen)
    if case == "table_requires_grad":
        cos.requires_grad_()
        sin.requires_grad_()
        qo, ko = hf.apply_rotary_pos_emb(q, k, cos, sin)
        up = torch.randn_like(qo)
        got = torch.autograd.grad((qo * up).sum() + ko.sum(), (cos, sin))
        qr, kr = original(q, k, cos, sin)
        want = torch.autograd.grad((qr * up).sum() + kr.sum(), (cos, sin))
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    elif case == "float64":
        q, k, cos, sin = (a.double() for a in (q, k, cos, sin))
        qo, ko = hf.apply_rotary_pos_emb(q, k, cos, sin)
        qr, kr = original(q, k, cos, sin)
    elif case == "wider_table_dtype":
        q, k = q.bfloat16(), k.bfloat16()  # HF promotes bf16 * fp32 to an fp32 result
        qo, ko = hf.apply_rotary_pos_emb(q, k, cos, sin)
        qr, kr = original(q, k, cos, sin)
        assert qo.dtype == torch.float32
    else:  # q without a unit last stride
        q = q.transpose(-1, -2).contiguous().transpose(-1, -2)
        qo, ko = hf.apply_rotary_pos_emb(q, k, cos, sin)
        qr, kr = original(q, k, cos, sin)
    if case != "table_requires_grad":
        assert qo.dtype == qr.dtype and ko.dtype == kr.dtype
        torch.testing.assert_close(qo, qr, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(ko, kr, rtol=1e-6, atol=1e-6)
    assert kernel_calls.call_count == 0


def test_inference_output_is_a_view_of_tokens_first_result(kernel_calls):
    """No copies around the kernel: the output is ropekit's (B, S, H, D) result viewed (B, H, S, D),
    which is also the layout HF's own elementwise math produces for these inputs."""
    gen = torch.Generator().manual_seed(13)
    q, k, cos, sin = _hf_inputs("plain", dtype=torch.float32, device="cpu", gen=gen)
    with torch.no_grad():
        qo, ko = hf.apply_rotary_pos_emb(q, k, cos, sin)
        qr, kr = _original("llama", "apply_rotary_pos_emb")(q, k, cos, sin)
    assert qo.stride() == q.stride() == qr.stride() and ko.stride() == k.stride()
    assert kernel_calls.call_count == 1


# ---------------------------------------------------------------------------------------------
# model parity: tiny models, patched vs unpatched (float32), both vs float64

V, HID, LAYERS, S_MODEL = PARITY_LM["vocab_size"], PARITY_LM["hidden_size"], PARITY_LM["num_hidden_layers"], 5
COMMON = PARITY_LM


def _build(name):
    """(model, extra forward kwargs, family, number of rotary calls per forward)."""
    T = transformers
    if name in ("llama", "mistral", "qwen2", "qwen3"):
        cfg_cls, model_cls = {
            "llama": (T.LlamaConfig, T.LlamaForCausalLM),
            "mistral": (T.MistralConfig, T.MistralForCausalLM),
            "qwen2": (T.Qwen2Config, T.Qwen2ForCausalLM),
            "qwen3": (T.Qwen3Config, T.Qwen3ForCausalLM),
        }[name]
        extra = dict(head_dim=16) if name == "qwen3" else {}
        return model_cls(cfg_cls(**COMMON, **extra)), {}, name, LAYERS
    if name == "phi3":  # partial rotary 0.5: 8 of 16 dims
        return T.Phi3ForCausalLM(T.Phi3Config(**COMMON, partial_rotary_factor=0.5)), {}, name, LAYERS
    if name == "glm":  # interleaved partial rotary
        return T.GlmForCausalLM(T.GlmConfig(**COMMON, head_dim=16, partial_rotary_factor=0.5)), {}, name, LAYERS
    if name == "gpt_neox":  # partial rotary 0.25: 4 of 16 dims, fused qkv
        return T.GPTNeoXForCausalLM(T.GPTNeoXConfig(**COMMON, rotary_pct=0.25)), {}, name, LAYERS
    if name.startswith("deepseek_v3"):  # MLA: rope on a 8-wide slice of 24-wide heads
        cfg = T.DeepseekV3Config(
            **{k: v for k, v in COMMON.items() if k != "num_key_value_heads"},
            num_key_value_heads=4,
            moe_intermediate_size=32,
            n_routed_experts=2,
            num_experts_per_tok=2,
            n_shared_experts=1,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=1,
            q_lora_rank=None,
            kv_lora_rank=32,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=16,
            rope_interleave=name == "deepseek_v3_interleave",
            experts_implementation="eager",
        )
        return T.DeepseekV3ForCausalLM(cfg), {}, "deepseek_v3", LAYERS
    if name == "llama4":  # complex freqs_cis; every expert routed
        cfg = T.Llama4TextConfig(
            **COMMON,
            head_dim=16,
            intermediate_size_mlp=96,
            num_local_experts=1,
            num_experts_per_tok=1,
            experts_implementation="eager",
        )
        model = T.Llama4ForCausalLM(cfg)
        n_rope = sum(bool(layer.self_attn.use_rope) for layer in model.model.layers)
        assert n_rope > 0
        return model, {}, name, n_rope
    if name in ("qwen2_vl", "qwen2_5_vl"):  # M-RoPE, sections merged in the rotary embedding
        cfg_cls, model_cls = {
            "qwen2_vl": (T.Qwen2VLConfig, T.Qwen2VLForConditionalGeneration),
            "qwen2_5_vl": (T.Qwen2_5_VLConfig, T.Qwen2_5_VLForConditionalGeneration),
        }[name]
        text = dict(COMMON, rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 3, 3]))
        vision = dict(
            depth=1,
            embed_dim=32,
            hidden_size=32,
            num_heads=2,
            out_hidden_size=HID,
            intermediate_size=32,
            patch_size=2,
            spatial_merge_size=1,
            temporal_patch_size=1,
        )
        model = model_cls(cfg_cls(text_config=text, vision_config=vision))
        t = torch.arange(S_MODEL)
        pos = torch.stack((t, t // 2 + 1, t % 3 + 2))[:, None, :].expand(3, 2, S_MODEL)  # distinct t / h / w rows
        return model, dict(position_ids=pos), name, LAYERS
    raise KeyError(name)


MODELS = [
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "qwen2_vl",
    "qwen2_5_vl",
    "llama4",
    "deepseek_v3",
    "deepseek_v3_interleave",
    "phi3",
    "glm",
    "gpt_neox",
]


def _forward_backward(model, ids, extra, up):
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, **extra).logits
    (logits * up.to(logits.dtype)).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("name", MODELS)
def test_model_parity(name, kernel_calls):
    torch.manual_seed(0)
    model, extra, family, n_rope = _build(name)
    model = model.float().eval()
    model.config._attn_implementation = "eager"
    ids = torch.randint(3, V, (2, S_MODEL))
    up = torch.randn(2, S_MODEL, V)

    logits0, grads0 = _forward_backward(model, ids, extra, up)
    assert kernel_calls.call_count == 0
    model64 = copy.deepcopy(model).double()
    logits64, grads64 = _forward_backward(model64, ids, extra, up)

    module = _module(family)
    names = [n for e in hf_census.scan() if e.module == module.__name__ for n in e.names]
    hf_fns = {a: getattr(module, a) for a in names}
    with hf.patched(model) as done:
        assert family in done
        for attr in done[family]:
            assert getattr(module, attr).ropekit_original is hf_fns[attr]
        at_patch = kernel_calls.call_count  # patch classifies functions by running the forms once
        logits1, grads1 = _forward_backward(model, ids, extra, up)
        calls = kernel_calls.call_count - at_patch
        # can this comparison fail? rotating by the inverse angle moves the logits far away
        fn_name = (
            "apply_rotary_emb"
            if family == "llama4"
            else ("apply_rotary_pos_emb_interleave" if name == "deepseek_v3_interleave" else "apply_rotary_pos_emb")
        )
        good = hf_fns[fn_name]  # HF's own function, rotating the wrong way
        if family == "llama4":
            wrong = lambda xq, xk, f: good(xq, xk, f.conj())  # noqa: E731
        else:
            wrong = lambda q, k, c, s, *a, **kw: good(q, k, c, -s, *a, **kw)  # noqa: E731
        with mock.patch.object(module, fn_name, wrong), torch.no_grad():
            logits_wrong = model(input_ids=ids, **extra).logits
    for attr, fn in hf_fns.items():  # restored
        assert getattr(module, attr) is fn
    # the forward reached ropekit once per rotary layer (the backward calls the op directly)
    assert calls == n_rope, f"{calls} kernel calls, expected {n_rope} (did the patch take effect?)"

    tol32, tol64 = 2e-6, 2e-5
    assert _rel(logits1, logits0) < tol32
    assert _rel(logits1, logits64) < tol64 / 2 and _rel(logits0, logits64) < tol64 / 2
    assert _rel(logits_wrong, logits0) > 100 * tol64, "the parity check could not tell a wrong rotation"
    assert grads1.keys() == grads0.keys() == grads64.keys() and len(grads0) > 0
    for n in grads0:
        assert _rel(grads1[n], grads0[n]) < 10 * tol32, f"grad {n}: {_rel(grads1[n], grads0[n]):.2e}"
        assert _rel(grads1[n], grads64[n]) < tol64, f"grad {n} vs float64: {_rel(grads1[n], grads64[n]):.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("name", MODELS)
def test_model_parity_cuda(name, kernel_calls):
    """The same models on CUDA: patched vs unpatched in float32, logits and every gradient; in
    bf16 the patched model is no further from the float32 logits than HF's own bf16 math is."""
    torch.manual_seed(0)
    model, extra, family, n_rope = _build(name)
    model = model.float().eval().cuda()
    model.config._attn_implementation = "eager"
    ids = torch.randint(3, V, (2, S_MODEL), device="cuda")
    extra = {k: v.cuda() for k, v in extra.items()}
    up = torch.randn(2, S_MODEL, V, device="cuda")
    logits0, grads0 = _forward_backward(model, ids, extra, up)
    with hf.patched(model):
        at_patch = kernel_calls.call_count  # patch classifies functions by running the forms once
        logits1, grads1 = _forward_backward(model, ids, extra, up)
    assert kernel_calls.call_count - at_patch == n_rope
    assert _rel(logits1, logits0) < 1e-5
    assert grads1.keys() == grads0.keys()
    for n in grads0:
        assert _rel(grads1[n], grads0[n]) < 5e-5, n
    model = model.bfloat16()
    with torch.no_grad():
        lb0 = model(input_ids=ids, **extra).logits
        with hf.patched(model):
            lb1 = model(input_ids=ids, **extra).logits
    e0, e1 = _rel(lb0, logits0), _rel(lb1, logits0)
    assert e1 < 1.5 * e0 + 5e-3, f"bf16: patched {e1:.3g} vs HF {e0:.3g} from the float32 logits"


# ---------------------------------------------------------------------------------------------
# patch / unpatch


def test_patch_global_and_unpatch():
    wanted = ["llama", "gpt_neox", "deepseek_v3", "llama4", "glm"]
    originals = {f: {a: getattr(_module(f), a) for a in hf.FAMILIES[f] if hasattr(_module(f), a)} for f in wanted}
    done = hf.patch(families=wanted)
    assert set(done) == set(wanted)
    for f in wanted:
        # the table's drop-ins, and any other rotary function of the module the census patched
        # (Llama 4's vision_apply_rotary_emb)
        assert set(originals[f]) <= set(done[f])
        for a in done[f]:
            replaced = getattr(_module(f), a)
            assert replaced.ropekit_original is originals[f].setdefault(a, replaced.ropekit_original)
    assert hf.patch(families=["llama"]) == {"llama": ["apply_rotary_pos_emb"]}  # idempotent
    restored = hf.unpatch()
    assert set(restored) == set(wanted)
    for f in wanted:
        for a, fn in originals[f].items():
            assert getattr(_module(f), a) is fn
    assert hf.unpatch() == {}


def test_patch_all_families_and_required_ones_present():
    required = {
        "llama",
        "mistral",
        "qwen2",
        "qwen3",
        "qwen2_vl",
        "qwen2_5_vl",
        "llama4",
        "deepseek_v3",
        "phi3",
        "glm",
        "gpt_neox",
    }
    assert required <= set(hf.FAMILIES)
    done = hf.patch()
    assert required <= set(done)
    assert hf.unpatch().keys() == done.keys()


def test_patch_refuses_unknown_families():
    with pytest.raises(ValueError, match="not_a_family"):
        hf.patch(families=["llama", "not_a_family"])
    with pytest.raises(ValueError, match="bert"):
        hf.patch(families="bert")
    assert hf._ORIGINALS == {}, "nothing may be patched when refusing"


def test_patch_model_finds_its_family_only():
    torch.manual_seed(0)
    model, _, _, _ = _build("phi3")
    llama_fn = _module("llama").apply_rotary_pos_emb
    done = hf.patch(model)
    assert done == {"phi3": ["apply_rotary_pos_emb"]}
    assert _module("llama").apply_rotary_pos_emb is llama_fn
    hf.unpatch()
    assert hf.patch(model, families=["llama"]) == {}  # intersection: nothing of llama in it
    with pytest.raises(ValueError, match="model"):
        hf.patch(torch.nn.Linear(2, 2))


def test_patched_context_restores_only_its_own():
    hf.patch(families=["llama"])
    with hf.patched(families=["llama", "qwen2"]) as done:
        assert set(done) == {"llama", "qwen2"}
    assert _module("llama").apply_rotary_pos_emb.ropekit_form == "llama"  # patched before: kept
    assert _module("qwen2").apply_rotary_pos_emb is _original("qwen2", "apply_rotary_pos_emb")
    assert not hasattr(_module("qwen2").apply_rotary_pos_emb, "ropekit_form")


def test_public_names():
    for name in hf.__all__:
        assert hasattr(hf, name), name
