"""ropekit.distributed: DTensor with ropekit's ops, for users (the rules live in ropekit.core.sharding).

The public ops (apply_rope, rotate_with_angles, apply_rope_and_store, RotaryEmbedding) take DTensor
q / k and register the custom ops' sharding rules themselves, on their first DTensor call. What
a user needs beyond that:

    replicate(table, mesh)   a plain tensor every rank holds as a replicated DTensor, without
                             communication (the custom ops, called directly, take DTensors only)
    check(op, {name: value}) the placements a custom op (a key of OPS) will run with, or the
                             ValueError its rule raises inside DTensor's dispatcher, before a call
    register()               install the rules now (idempotent): needed only before calling the
                             custom ops (torch.ops.ropekit.*) directly on DTensors
    OPS                      the custom ops that have rules, and their schemas' roles

The layouts each rule accepts: ropekit.core.sharding's docstring, and docs/packed.md.
"""

from __future__ import annotations

import torch

from ..core.sharding import OPS, check, register

__all__ = ["OPS", "check", "register", "replicate"]


def replicate(x: torch.Tensor, mesh):
    """A plain tensor (a cos/sin table) as a DTensor replicated on `mesh`, without communication
    (every rank must hold the same values)."""
    from torch.distributed.tensor import DTensor, Replicate

    return DTensor.from_local(x, mesh, [Replicate()] * mesh.ndim, run_check=False)
