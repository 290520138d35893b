"""ropekit.torchtitan: torchtitan's RoPE modules rotating q and k through ropekit, as torchtitan overrides.

    torchtitan_train ... --override.imports ropekit.torchtitan.cos_sin_rope,ropekit.torchtitan.complex_rope

Each override is torchtitan's own mechanism (`@override(target=X.Config, exact=True)` returning
`derive(cfg, Y.Config)`, as `torchtitan.overrides.helion_rope` does): the exact config class becomes
a subclass whose module keeps torchtitan's config, constructor and `cache` buffer (state_dict,
checkpoints and sharding config unchanged) and replaces `forward`:

    cos_sin_rope   CosSinRoPE (Qwen3, GPT-OSS): ropekit.apply_rope, half-split pairs
    complex_rope   ComplexRoPE (Llama 3, DeepSeek V3): ropekit.apply_rope(interleaved=True)
    mrope          Qwen3.5's MRoPE: ropekit's interleaved M-RoPE for (B, S, 3) positions, CosSinRoPE's
                   rotation for (B, S) ones (registered where torchtitan's qwen3_5 imports: it needs `fla`)

The table ropekit reads is made from the module's own cache (its values, whatever the scaling;
caches.py), and the kernel gathers each token's row by its position, forward and backward
(autograd through ropekit). Subclasses with other cache contracts are left to torchtitan
(`exact=True`).
"""

from __future__ import annotations

from dataclasses import dataclass

from torchtitan.config import derive, override
from torchtitan.models.common.rope import ComplexRoPE, CosSinRoPE

from . import caches

try:  # Qwen3.5's package imports flash-linear-attention (`fla`)
    from torchtitan.models.qwen3_5.rope import MRoPE
except ImportError:
    MRoPE = None

# torchtitan names an override by its factory's `module.function`: the public path users type
PUBLIC = "ropekit.torchtitan"


class _Rotation:
    """What the overrides share: the table of this module's cache, kept beside it (not a buffer)."""

    convert = None  # caches.cos_sin_table or caches.complex_table
    interleaved = False

    def ropekit_table(self):
        table = self.__dict__.get("ropekit_table_memo")
        if table is None:
            table = self.__dict__["ropekit_table_memo"] = caches.Table(type(self).convert)
        return table(self.cache)

    def forward(self, query, key, positions=None):
        return caches.rotate(query, key, positions, self.ropekit_table(), interleaved=self.interleaved)


class RopekitCosSinRoPE(_Rotation, CosSinRoPE):
    """torchtitan's CosSinRoPE (same config, constructor, cache) rotating through ropekit."""

    @dataclass(kw_only=True, slots=True)
    class Config(CosSinRoPE.Config):
        pass

    convert = staticmethod(caches.cos_sin_table)


class RopekitComplexRoPE(_Rotation, ComplexRoPE):
    """torchtitan's ComplexRoPE (same config, constructor, cache) rotating through ropekit."""

    @dataclass(kw_only=True, slots=True)
    class Config(ComplexRoPE.Config):
        pass

    convert = staticmethod(caches.complex_table)
    interleaved = True


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
        """Qwen3.5's MRoPE (same config, constructor, cache) rotating through ropekit."""

        @dataclass(kw_only=True, slots=True)
        class Config(MRoPE.Config):
            pass

        convert = staticmethod(caches.cos_sin_table)

        def forward(self, query, key, positions=None):
            hw = tuple(self.config.mrope_section[1:]) if positions is not None and positions.ndim == 3 else None
            return caches.rotate(query, key, positions, self.ropekit_table(), interleaved=False, mrope_hw=hw)

    @override(target=MRoPE.Config, exact=True, description="ropekit: Qwen3.5 MRoPE through ropekit's M-RoPE")
    @_public
    def mrope(cfg: MRoPE.Config) -> RopekitMRoPE.Config:
        return derive(cfg, RopekitMRoPE.Config)
