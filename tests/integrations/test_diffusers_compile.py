"""ropekit.diffusers under torch.compile: nothing Dynamo guards on changes after patch(), and
blocks compiled one by one (diffusers' compile_repeated_blocks) share one graph per block class.

Counted with a backend that records each graph it is handed; fullgraph=True throughout (a graph
break would fail). Tiny random-weight Flux.1 and Wan 2.1 built by the tests' helpers.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("diffusers")

import ropekit.diffusers as rd  # noqa: E402

from helpers.diffusers_models import BUILDERS  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh():
    rd.unpatch()
    torch._dynamo.reset()
    yield
    rd.unpatch()
    torch._dynamo.reset()


def _counting():
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    return graphs, backend


def _blocks(model):
    names = set(model._repeated_blocks)
    return [m for m in model.modules() if type(m).__name__ in names]


def _compile_blocks(model, kwargs):
    """(graphs compiled by the first forward, the first output, the second output); the second
    forward must not recompile."""
    graphs, backend = _counting()
    for block in _blocks(model):
        block.compile(backend=backend, fullgraph=True)
    with torch.no_grad():
        first = model(**kwargs, return_dict=False)[0]
        n = len(graphs)
        with torch._dynamo.config.patch(error_on_recompile=True):
            again = model(**kwargs, return_dict=False)[0]
    return n, first, again


@pytest.mark.parametrize("family", ["flux", "wan"])
@pytest.mark.parametrize("mode", ["model", "every model"])
def test_repeated_blocks_compile_as_often_as_unpatched(family, mode):
    """As many graphs as the unpatched model's blocks take (one per block class, plus any
    recompile diffusers' own code makes: the tiny Flux's first single block sees other strides),
    and no recompile on the next call."""
    torch.manual_seed(0)
    model, inputs = BUILDERS[family](layers=2)
    kwargs = inputs(torch.Generator().manual_seed(1))
    base, want, _ = _compile_blocks(copy.deepcopy(model), kwargs)
    torch._dynamo.reset()
    report = rd.patch(model if mode == "model" else None)
    assert mode != "model" or report[family] > 0
    n, first, again = _compile_blocks(model, kwargs)
    assert n == base, f"{n} graphs patched, {base} unpatched"
    assert n < len(_blocks(model)), "a graph per block"
    torch.testing.assert_close(first, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(again, first, rtol=0, atol=0)


def _flux_block_step(model, kwargs):
    block = model.transformer_blocks[0]

    def step(hs, ehs, temb, ids):
        emb = model.pos_embed(ids)
        e, h = block(hidden_states=hs, encoder_hidden_states=ehs, temb=temb, image_rotary_emb=emb)
        return h.square().sum() + e.sum()

    return step


def _flux_block_inputs(S_img, S_txt=3, seed=3):
    g = torch.Generator().manual_seed(seed)
    img_ids = torch.stack([torch.zeros(S_img), torch.arange(S_img) // 3, torch.arange(S_img) % 3], -1).float()
    ids = torch.cat((torch.zeros(S_txt, 3), img_ids))
    hs = torch.randn(1, S_img, 32, generator=g, requires_grad=True)
    return hs, torch.randn(1, S_txt, 32, generator=g), torch.randn(1, 32, generator=g), ids


@pytest.mark.parametrize("dynamic", [False, True])
def test_compiled_block_matches_eager_over_shapes(dynamic):
    """A patched Flux double-stream block, fullgraph, over three sequence lengths: output and the
    gradient of the hidden states as eager."""
    torch.manual_seed(0)
    model, inputs = BUILDERS["flux"]()
    rd.patch(model)
    step = _flux_block_step(model, inputs(torch.Generator().manual_seed(1)))
    compiled = torch.compile(step, fullgraph=True, dynamic=dynamic, backend="aot_eager")
    for S_img in (6, 9, 12):
        args = _flux_block_inputs(S_img)
        eager = step(*args)
        (d_eager,) = torch.autograd.grad(eager, args[0])
        got = compiled(*args)
        (d_got,) = torch.autograd.grad(got, args[0])
        torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(d_got, d_eager, rtol=1e-5, atol=1e-5)
