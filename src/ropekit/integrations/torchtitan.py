"""ropekit inside torchtitan: its RoPE modules rotate q and k through ropekit, as torchtitan overrides.

    torchtitan_train ... --override.imports ropekit.torchtitan.cos_sin_rope,ropekit.torchtitan.complex_rope

Each override (torchtitan's `@override(target=..., exact=True)`, the mechanism of its own
`torchtitan.overrides.helion_rope`) turns the exact config class into a subclass whose module keeps
torchtitan's config, constructor and `cache` buffer (state_dict and checkpoints unchanged) and
replaces only `forward`:

    cos_sin_rope   CosSinRoPE (Qwen3, GPT-OSS): cache rows [cos f, cos f, sin f, sin f] (width 2 D),
                   rotate-half; ropekit.apply_rope with the table [cos f | sin f]
    complex_rope   ComplexRoPE (Llama 3, DeepSeek V3): complex64 cache e^(i f) (width D / 2),
                   adjacent pairs; ropekit.apply_rope(interleaved=True) with the table [cos f | sin f]
    mrope          Qwen3.5's MRoPE (a CosSinRoPE whose (B, S, 3) positions pick t / h / w per
                   frequency, interleaved); ropekit's M-RoPE, mrope_interleaved=True

The table is read from the module's own cache (same values, whatever the scaling) once per cache
tensor and kept beside it (not a buffer); a new cache (`.to()`, `init_states`, an in-place write)
makes a new table. The kernel gathers each token's row by its position, forward and backward
(autograd through ropekit: the inverse rotation). Positions are bounds-checked as torchtitan does
(an async assert, no host sync, skipped under torch.compile).

DTensors as torchtitan passes them under tensor parallelism: q and k head-sharded, the cache a
replicated DTensor (its local tensor is the table's source), positions wrapped on q's mesh the way
torchtitan's own RoPE wraps them; ropekit's sharding rules run each rank on its local shards.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torchtitan.config import derive, override
from torchtitan.models.common.rope import ComplexRoPE, CosSinRoPE

import ropekit

try:  # Qwen3.5's package imports flash-linear-attention (`fla`): mrope exists where it imports
    from torchtitan.models.qwen3_5.rope import MRoPE
except ImportError as e:
    MRoPE, MROPE_IMPORT_ERROR = None, e
else:
    MROPE_IMPORT_ERROR = None

# torchtitan names an override by its factory's `module.function`: the public path users type
PUBLIC = "ropekit.torchtitan"
OP = "ropekit.torchtitan"


def _local(x):
    return x.to_local() if isinstance(x, DTensor) else x


def cos_sin_table(cache: torch.Tensor) -> torch.Tensor:
    """CosSinRoPE's (max_seq_len, 2 D) rows [cos f, cos f, sin f, sin f] as ropekit's (max_seq_len, D)
    [cos f | sin f] (a copy: the halves ropekit reads are not one strided view)."""
    half = cache.shape[-1] // 4
    return torch.cat((cache[:, :half], cache[:, 2 * half : 3 * half]), dim=-1)


def complex_table(cache: torch.Tensor) -> torch.Tensor:
    """ComplexRoPE's (max_seq_len, D / 2) complex64 e^(i f) as ropekit's (max_seq_len, D) [cos f | sin f]."""
    return torch.cat((cache.real, cache.imag), dim=-1)


class _Rotation:
    """The forward every override shares: the memoized table, the positions as ropekit takes them."""

    _interleaved = False

    def _table(self) -> torch.Tensor:
        cache = self.cache
        if isinstance(cache, DTensor) and not all(isinstance(p, Replicate) for p in cache.placements):
            raise ValueError(f"{OP}: cache: expected a replicated DTensor or a tensor, got {cache.placements}")
        cache = _local(cache)
        memo = self.__dict__.get("_ropekit_table")
        if memo is not None and memo[0]() is cache and memo[1] == cache._version:
            return memo[2]
        with torch.no_grad():
            table = self._to_table(cache).float().contiguous()
        self.__dict__["_ropekit_table"] = (weakref.ref(cache), cache._version, table)
        return table

    def _rotate(self, query, key, positions, mrope_section=None):
        table = self._table()
        if positions is not None:
            _check_max_pos(positions, table.shape[0] - 1)
            positions = _positions_like(positions, query)
        if mrope_section is not None:  # torchtitan's (B, S, 3) as ropekit's (3, B, S): a view
            positions = positions.permute(2, 0, 1)
        return ropekit.apply_rope(
            query,
            key,
            positions,
            table,
            interleaved=self._interleaved,
            mrope_section=mrope_section,
            mrope_interleaved=mrope_section is not None,
        )


def _check_max_pos(positions: torch.Tensor, max_valid_pos: int) -> None:
    """torchtitan's bounds check (ropekit alone would write NaN for such a token): async, no sync."""
    if torch.compiler.is_compiling():
        return
    torch._assert_async(torch.all(_local(positions) <= max_valid_pos), f"position_ids exceed {max_valid_pos=}")


def _positions_like(positions: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """Plain positions next to a DTensor q become a DTensor on q's mesh, as torchtitan's RoPE makes
    them: q's token-dim shards kept, its other shards (heads) replicated."""
    if not isinstance(query, DTensor) or isinstance(positions, DTensor):
        return positions
    ndim = positions.ndim
    placements = tuple(Replicate() if isinstance(p, Shard) and p.dim >= ndim else p for p in query.placements)
    return DTensor.from_local(positions, query.device_mesh, placements, run_check=False)


class RopekitCosSinRoPE(_Rotation, CosSinRoPE):
    """torchtitan's CosSinRoPE (same config, constructor, cache) rotating through ropekit."""

    @dataclass(kw_only=True, slots=True)
    class Config(CosSinRoPE.Config):
        pass

    _to_table = staticmethod(cos_sin_table)

    def forward(self, query, key, positions=None):
        return self._rotate(query, key, positions)


class RopekitComplexRoPE(_Rotation, ComplexRoPE):
    """torchtitan's ComplexRoPE (same config, constructor, cache) rotating through ropekit."""

    @dataclass(kw_only=True, slots=True)
    class Config(ComplexRoPE.Config):
        pass

    _to_table = staticmethod(complex_table)
    _interleaved = True

    def forward(self, query, key, positions=None):
        return self._rotate(query, key, positions)


def _public(fn):
    fn.__module__ = PUBLIC
    return fn


@override(target=CosSinRoPE.Config, exact=True, description="ropekit: CosSinRoPE through ropekit.apply_rope")
@_public
def cos_sin_rope(cfg: CosSinRoPE.Config) -> RopekitCosSinRoPE.Config:
    return derive(cfg, RopekitCosSinRoPE.Config)


@override(target=ComplexRoPE.Config, exact=True, description="ropekit: ComplexRoPE through ropekit.apply_rope")
@_public
def complex_rope(cfg: ComplexRoPE.Config) -> RopekitComplexRoPE.Config:
    return derive(cfg, RopekitComplexRoPE.Config)


if MRoPE is not None:

    class RopekitMRoPE(_Rotation, MRoPE):
        """Qwen3.5's MRoPE (same config, constructor, cache) rotating through ropekit: (B, S, 3) positions
        as ropekit's (3, B, S) with its interleaved M-RoPE; (B, S) or None as CosSinRoPE."""

        @dataclass(kw_only=True, slots=True)
        class Config(MRoPE.Config):
            pass

        _to_table = staticmethod(cos_sin_table)

        def forward(self, query, key, positions=None):
            if positions is None or positions.ndim != 3:
                return self._rotate(query, key, positions)
            # torchtitan reads h and w only (t drives every other frequency): the t count follows from them
            _, h, w = self.config.mrope_section
            return self._rotate(query, key, positions, mrope_section=(self.config.dim // 2 - h - w, h, w))

    @override(target=MRoPE.Config, exact=True, description="ropekit: Qwen3.5 MRoPE through ropekit's M-RoPE")
    @_public
    def mrope(cfg: MRoPE.Config) -> RopekitMRoPE.Config:
        return derive(cfg, RopekitMRoPE.Config)
