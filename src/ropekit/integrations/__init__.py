"""Integrations with other libraries (transformers, diffusers, DTensor, the kernels hub): they call
the public ops only. Their public paths are ropekit.hf, ropekit.diffusers, ropekit.distributed, ..."""
