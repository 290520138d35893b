"""Integrations with other libraries (transformers, diffusers, DTensor, the kernels hub): they call
the public ops only. Their public paths are ropekit.hf, ropekit.diffusers, ropekit.distributed, ...
hf_config (HF model configs read into RotaryEmbedding's arguments) calls no op: it ranks below the
api, whose RotaryEmbedding.from_hf_config uses it."""
