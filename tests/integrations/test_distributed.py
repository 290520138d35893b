"""DTensor inputs through ropekit's custom ops: two gloo processes on CPU, kernels interpreted.

tests/helpers/dtensor_worker.py runs on two ranks (127.0.0.1, a free port); this test compares what
rank 0 gathered with the float64 reference: outputs of token-, batch- and head-sharded and
replicated calls, gradients (sharded and replicated upstream gradients), the in-place op, and the
named errors for layouts that would need communication.
"""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ropekit
from ropekit.tools import reference

pytest.importorskip("torch.distributed.tensor", reason="needs torch.distributed.tensor (DTensor)")
if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("needs torch.distributed with gloo", allow_module_level=True)

WORKER = Path(__file__).resolve().parents[1] / "helpers" / "dtensor_worker.py"
SRC = Path(__file__).resolve().parents[2] / "src"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def gathered(tmp_path_factory):
    out = tmp_path_factory.mktemp("dtensor") / "results.pt"
    port = free_port()
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(r), "2", str(port), str(out)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for r in range(2)
    ]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=120)[0].decode(errors="replace"))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("gloo workers timed out")
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-4000:]
    return torch.load(out)


def reference_case(c, upstream=True):
    q, k = c["q"].double().requires_grad_(), c["k"].double().requires_grad_()
    qo, ko = reference.apply_rope(q, k, c["pos"], c["cache"].double())
    if upstream:
        loss = (qo * c["wq"].double()).sum() + (ko * c["wk"].double()).sum() + qo.sum() + ko.sum()
        loss.backward()
        return qo, ko, q.grad, k.grad, loss
    return qo, ko


CASES = ["thd_tokens", "bshd_tokens", "bshd_batch", "thd_heads", "replicate", "positions_replicated_sliced"]


@pytest.mark.parametrize("case", CASES)
def test_forward_and_backward_match_float64(gathered, case):
    c = gathered["results"][case]
    qo, ko, gq, gk, loss = reference_case(c)
    for got, want in ((c["qo"], qo), (c["ko"], ko), (c["gq"], gq), (c["gk"], gk)):
        assert not torch.isnan(got).any()
        torch.testing.assert_close(got.double(), want.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(c["loss"].double(), loss.detach(), rtol=1e-4, atol=1e-4)


def test_inplace_head_sharded(gathered):
    c = gathered["results"]["inplace_heads"]
    qo, ko = reference_case(c, upstream=False)
    torch.testing.assert_close(c["qo"].double(), qo.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(c["ko"].double(), ko.detach(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["head_table_heads", "head_table_tokens"])
def test_head_table_sharded_forward_and_backward(gathered, case):
    """A per-head table: sliced on its heads with head-sharded q / k, replicated with token sharding."""
    c = gathered["results"][case]
    q, k = c["q"].double().requires_grad_(), c["k"].double().requires_grad_()
    qo, ko = reference.apply_rope(q, k, c["pos"], c["cache"].double())
    (qo.sum() + (ko * ko.detach()).sum()).backward()
    for got, want in ((c["qo"], qo), (c["ko"], ko), (c["gq"], q.grad), (c["gk"], k.grad)):
        assert not torch.isnan(got).any()
        torch.testing.assert_close(got.double(), want.detach(), rtol=1e-5, atol=1e-5)


def test_per_token_angles_token_sharded(gathered):
    c = gathered["results"]["angles_tokens"]
    qo, ko = reference_case(c, upstream=False)
    torch.testing.assert_close(c["qo"].double(), qo.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(c["ko"].double(), ko.detach(), rtol=1e-5, atol=1e-5)


def test_mrope_token_sharded(gathered):
    c = gathered["results"]["mrope_tokens"]
    qo, ko = reference.apply_rope(
        c["q"].double(), c["k"].double(), c["pos"], c["cache"].double(), mrope_section=(4, 6, 6)
    )
    torch.testing.assert_close(c["qo"].double(), qo, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(c["ko"].double(), ko, rtol=1e-5, atol=1e-5)


def test_store_head_sharded(gathered):
    c = gathered["results"]["store_heads"]
    q, kc, vc = c["q"].double(), c["k_cache"].double(), c["v_cache"].double()
    reference.apply_rope_and_store(
        q, c["k"].double(), c["v"].double(), c["pos"], c["cache"].double(), kc, vc, c["slots"]
    )
    torch.testing.assert_close(c["qo"].double(), q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(c["k_cache_out"].double(), kc, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(c["v_cache_out"].double(), vc, rtol=0, atol=0)


def test_store_norm_packed_head_sharded(gathered):
    c = gathered["results"]["store_norm_packed_heads"]
    positions = ropekit.positions_from_cu_seqlens(c["cu"])
    kw = dict(q_norm_weight=c["wq"].double(), k_norm_weight=c["wk"].double(), norm_weight_offset=1.0)
    q, kc = c["q"].double(), torch.full(c["k_cache_out"].shape, float("nan"), dtype=torch.float64)
    vc = kc.clone()
    reference.apply_rope_and_store(
        q, c["k"].double(), c["v"].double(), positions, c["cache"].double(), kc, vc, c["slots"], **kw
    )
    torch.testing.assert_close(c["qo"].double(), q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(c["k_cache_out"].double(), kc, rtol=1e-5, atol=1e-5, equal_nan=True)
    torch.testing.assert_close(c["v_cache_out"].double(), vc, rtol=0, atol=0, equal_nan=True)


def test_packed_head_sharded_forward_and_backward(gathered):
    c = gathered["results"]["packed_heads"]
    positions = ropekit.positions_from_cu_seqlens(c["cu"])
    q, k = c["q"].double().requires_grad_(), c["k"].double().requires_grad_()
    qo, ko = reference.apply_rope(q, k, positions, c["cache"].double())
    (qo.sum() + 2 * ko.sum()).backward()
    for got, want in ((c["qo"], qo), (c["ko"], ko), (c["gq"], q.grad), (c["gk"], k.grad)):
        torch.testing.assert_close(got.double(), want.detach(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["norm_heads", "norm_tokens_across"])
def test_norm_sharded_forward_and_backward(gathered, case):
    """The QK-norm on DTensors: outputs and gradients of q, k and q's weight (a Partial sum over
    the shards, reduced by DTensor) against float64."""
    c = gathered["results"][case]
    q, k = c["q"].double().requires_grad_(), c["k"].double().requires_grad_()
    wq = c["wq"].double().requires_grad_()
    cos, sin = reference.angles_from_table(c["cache"].double(), c["pos"], (8,))
    qo = reference.rotate(reference.rms_norm(q, wq, eps=1e-6, offset=0.0), cos, sin)
    ko = reference.rotate(reference.rms_norm(k, c["wk"].double(), eps=1e-6, offset=0.0), cos, sin)
    (qo.sum() + 2 * ko.sum()).backward()
    for got, want in ((c["qo"], qo), (c["ko"], ko), (c["gq"], q.grad), (c["gk"], k.grad), (c["gwq"], wq.grad)):
        torch.testing.assert_close(got.double(), want.detach(), rtol=1e-5, atol=1e-5)


def test_freqs_token_sharded(gathered):
    c = gathered["results"]["freqs_tokens"]
    angle = ropekit.core.freqs.pair_positions(c["pos"].double(), (4, 4, 8), 16) * c["inv_freq"].double()
    for got, x in ((c["qo"], c["q"]), (c["ko"], c["k"])):
        want = reference.rotate(x.double(), angle.cos(), angle.sin(), interleaved=True)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "case,fragment",
    [
        (
            "norm_across_heads_sharded",
            "ropekit.rotate: q_norm_weight: expected a per-head (D,) weight when q / k are sharded on heads",
        ),
        (
            "packed_token_sharded",
            "ropekit.rotate: q: expected a head-dim or replicated placement with cu_seqlens",
        ),
        ("store_token_sharded", "ropekit.rope_and_store: q: expected a head-dim or replicated placement"),
        (
            "store_norm_across_heads_sharded",
            "ropekit.rope_and_store: k_norm_weight: expected a per-head (D,) weight when q / k are sharded on heads",
        ),
        ("positions_sharded_under_head_sharding", "ropekit.rotate: positions: expected placements (Replicate(),)"),
        ("k_on_other_dim", "ropekit.rotate: k: expected placement Shard(dim=0) on mesh dim 0"),
        ("shard_of_head_size", "ropekit.rotate: q: expected placements Replicate(), Shard(token dim) or Shard(head"),
    ],
)
def test_refused_layouts_name_the_argument(gathered, case, fragment):
    msg = gathered["errors"][case]
    assert msg is not None, f"{case}: the call did not raise"
    assert msg.startswith(fragment), msg


def _run_python(code: str) -> None:
    env = dict(os.environ, PYTHONPATH=f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]


def test_import_has_no_side_effects():
    """`import ropekit` defines names only: no import hook, and DTensor (~1 s) not imported."""
    _run_python(
        "import sys\n"
        "before = list(sys.meta_path)\n"
        "import ropekit, ropekit.distributed\n"
        "assert sys.meta_path == before, sys.meta_path\n"
        "assert 'torch.distributed.tensor' not in sys.modules, 'ropekit imported DTensor'\n"
    )


def test_rules_registered_on_the_first_dtensor_call_even_under_compile():
    """Importing DTensor registers nothing; the first call of a public op on DTensors does, also
    when that call is traced by torch.compile (fullgraph: registering must not break the graph)."""
    _run_python(
        "import os\n"
        "os.environ['TRITON_INTERPRET'] = '1'\n"
        "import torch, ropekit\n"
        "import torch.distributed as dist\n"
        "from torch.distributed.tensor import DTensor, DeviceMesh, Replicate, Shard, distribute_tensor\n"
        "funcs = DTensor._op_dispatcher.sharding_propagator.op_strategy_funcs\n"
        "ops = [getattr(torch.ops.ropekit, n).default for n in ropekit.distributed.OPS]\n"
        "assert not any(op in funcs for op in ops), 'registered before any DTensor call'\n"
        "dist.init_process_group('gloo', store=dist.HashStore(), rank=0, world_size=1)\n"
        "mesh = DeviceMesh('cpu', [0])\n"
        "q = distribute_tensor(torch.randn(8, 4, 32), mesh, [Shard(1)])\n"
        "k = distribute_tensor(torch.randn(8, 2, 32), mesh, [Shard(1)])\n"
        "pos = distribute_tensor(torch.arange(8), mesh, [Replicate()])\n"
        "cache = torch.randn(64, 32)\n"
        "f = torch.compile(ropekit.apply_rope, backend='eager', fullgraph=True)\n"
        "qo, ko = f(q, k, pos, cache)\n"
        "assert all(op in funcs for op in ops), 'not registered by the first DTensor call'\n"
        "assert tuple(qo.placements) == (Shard(1),), qo.placements\n"
        "want, _ = ropekit.apply_rope(q.to_local(), k.to_local(), torch.arange(8), cache)\n"
        "torch.testing.assert_close(qo.to_local(), want)\n"
        "dist.destroy_process_group()\n"
        # core/sharding.py marks register() as torch.compiler.assume_constant_result would
        "def g():\n"
        "    pass\n"
        "torch.compiler.assume_constant_result(g)\n"
        "assert vars(g) == {'_dynamo_marked_constant': True}, vars(g)\n"
    )
