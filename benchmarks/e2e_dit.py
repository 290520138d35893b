"""Training and inference steps of small random-weight image / video transformers (Flux.1, Wan 2.1,
Flux 2, HunyuanVideo 1.5, LTX-2, a DINOv3 ViT) and of a Qwen3 language model, with and without
ropekit's patch.

    PYTHONPATH=src python benchmarks/e2e_dit.py --out OUT/e2e_dit.json [--quick] [--compile]
        [--models flux,wan,flux2,hunyuan_video15,ltx2,dinov3] [--step train,infer] [--steps 10]
        [--warmup 3] [--rounds 2] [--wan-latent 21,60,104] [--flux2-image 64,64]
        [--hv15-latent 16,30,53] [--ltx2-latent 16,16,24] [--vit-batch 32] [--vit-image 512]
        [--lm-layers 4] [--lm-tokens 2,4096]

The models are the libraries' own classes with their real widths and only a few blocks, random
weights from a fixed seed, on CUDA in bf16 (parameters cast as `from_pretrained(torch_dtype=
torch.bfloat16)` casts them: bf16 except the class's `_keep_in_fp32_modules`; buffers such as
Wan's float32 rotary table as the constructor made them). The diffusers ones are patched with
`ropekit.diffusers.patch(model)`, the transformers ones with `ropekit.hf.patch(model)` (Qwen3 with
`fuse_qk_norm=True`); diffusers is imported only when a diffusers model is selected.

    flux    Flux.1  FluxTransformer2DModel: 24 heads x 128 = 3072 wide, joint_attention_dim 4096,
            pooled_projection_dim 768, axes_dims_rope (16, 56, 56), in_channels 64 (2 x 2 packed
            latent patches), no guidance embedding; 2 double-stream + 4 single-stream blocks.
            Input: B=1, a 64 x 64 grid of packed patches (a 1024 x 1024 image) = 4096 image tokens
            and 512 text tokens: 4608 tokens through every attention (W13's shape).
    wan     Wan 2.1 WanTransformer3DModel with the 14B model's widths: 40 heads x 128 = 5120, ffn
            13824, text_dim 4096, in_channels 16, patch (1, 2, 2), QK-RMSNorm across heads; 2 blocks.
            Input: B=1, a 16 x 21 x 60 x 104 latent (81 frames at 480 x 832) = 21 x 30 x 52 =
            32,760 video tokens, and 512 text tokens (cross-attention). `--wan-latent 21,90,160`
            gives W14's 21 x 45 x 80 = 75,600 tokens (720p).
    flux2   Flux 2 [dev] Flux2Transformer2DModel (the class's defaults): 48 heads x 128 = 6144 wide,
            joint_attention_dim 15360, mlp_ratio 3, in_channels 128 (32-channel latent, 2 x 2
            packed), axes_dims_rope (32, 32, 32, 32) on (t, h, w, l) ids, rope_theta 2000, guidance
            embedding; 1 double-stream + 6 single-stream blocks (the model's 8 : 48).
            Input: B=1, 64 x 64 packed patches (1024 x 1024) = 4096 image tokens + 512 text tokens.
    hunyuan_video15
            HunyuanVideo 1.5 HunyuanVideo15Transformer3DModel (the 8.3B 480p model's widths): 16
            heads x 128 = 2048 wide, mlp_ratio 4, in_channels 65 (latent, condition latent, mask),
            rope_axes_dim (16, 56, 56); 2 double-stream blocks (and the 2-layer text refiner).
            Input: B=1, 61 frames at 480 x 848 = a 16 x 30 x 53 latent = 25,440 video tokens, and
            the pipeline's 1000 + 256 + 729 text / image slots (256 valid prompt tokens) joined
            to them in every attention (with the attention mask the model builds).
    ltx2    LTX-2 LTX2VideoTransformer3DModel (the 19B audio-video model's widths): video 32 heads
            x 128 = 4096, audio 32 x 64 = 2048, cross_attention_dim 4096, caption_channels 3840,
            QK-RMSNorm across heads, rope_type "split"; 4 blocks (each: video and audio
            self-attention, text cross-attention, audio-to-video and video-to-audio attention).
            Input: B=1, 121 frames at 512 x 768 (the pipeline's default) = a 16 x 16 x 24 latent =
            6144 video tokens, 126 audio tokens (5.04 s), 1024 text tokens for each stream.
    dinov3  DINOv3 ViT-L/16 DINOv3ViTModel (transformers): 16 heads x 64 = 1024 wide, ffn 4096, 4
            register tokens, 2-D RoPE on the patch tokens (rope_theta 100); 4 layers.
            Input: B=32 images at 512 x 512 = 32 x (1024 patches + 5 prefix tokens).
    qwen3   Qwen3-8B Qwen3Model (transformers, no LM head): 32 query / 8 key-value heads x 128 =
            4096 wide, ffn 12288, q / k RMSNorm per head (fused into the rotation by the patch),
            rope_theta 1e6; 4 layers. Input: B=2 sequences of 4096 tokens (W1's shape at Llama-3-
            8B's heads; the inference step is that prefill).
    qwen3_qkv  qwen3 with `ropekit.hf.fuse_qkv(model)` as the patch: each layer's q / k / v
            projections, q / k norm and rotation as one rope_qkv_projection call (the whole
            attention prologue; the unpatched side is the same HF model).

A training step is: gradients set to None, forward, MSE loss (float32) of every output to a fixed
random target, backward. No optimizer step: the weights stay fixed, so every step does the same
work and the patched and unpatched runs see the same weights. An inference step is one denoising
step (a ViT forward): the same model, in eval mode, and the same inputs, forward only under
torch.inference_mode(). Each variant (unpatched, patched) runs `warmup` steps then `steps` timed
ones (CUDA events around each step), `rounds` times in turn (unpatched, patched, unpatched, ...);
the figure is the median over all timed steps. The first step of each variant gives the outputs
(and, training, the loss and the gradient norm) compared. Checks (the script exits 1 if one
fails): training, the patched loss equals the unpatched one within `--loss-rtol` (bf16 default
8e-3, float32 1e-5); both steps, every output's error against the unpatched model run in float32
(same weights, upcast, no grad) is within 1.5x the unpatched output's own error plus 1e-3
(float32: 1e-5). The loss alone is a weak check (an MSE to a random target barely moves when the
output does); the output check catches a rotation by the wrong angle. The first patched step also
counts ropekit's calls (every call of a rotation op goes through one of `ropekit.core.dispatch.ROTATE`'s doors): a patch that did
nothing shows 0, and that row fails too. Peak memory: `torch.cuda.max_memory_allocated` over each
variant's steps.

`--compile` also times `torch.compile(model)` of both variants (patched before compiling; the
first step's wall time, compilation included, is recorded); a variant that fails to compile is
recorded with its error and the run goes on.

`--quick` shrinks everything to tiny configs (float32, a few tokens, 2 steps) that run on CPU
too; `tests/tools/test_e2e_dit.py` runs it. Output: the JSON file (one row per model, step and mode)
and a markdown table on stdout.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import platform
import statistics
import subprocess
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F

# Flux.1's widths (FluxTransformer2DModel's defaults) with 2 double- and 4 single-stream blocks
FLUX_FULL = dict(
    patch_size=1,
    in_channels=64,
    num_layers=2,
    num_single_layers=4,
    attention_head_dim=128,
    num_attention_heads=24,
    joint_attention_dim=4096,
    pooled_projection_dim=768,
    guidance_embeds=False,
    axes_dims_rope=(16, 56, 56),
)
FLUX_TINY = dict(in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2)
FLUX_CONFIG = {
    "full": FLUX_FULL,
    "quick": {
        **FLUX_FULL,
        **FLUX_TINY,
        "joint_attention_dim": 32,
        "pooled_projection_dim": 8,
        "axes_dims_rope": (4, 6, 6),
    },
}
FLUX_TOKENS = {"full": (64, 64, 512), "quick": (4, 4, 8)}  # image grid rows, columns; text tokens

# Wan 2.1 14B's widths (WanTransformer3DModel's defaults) with 2 blocks
WAN_FULL = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=40,
    attention_head_dim=128,
    in_channels=16,
    out_channels=16,
    text_dim=4096,
    freq_dim=256,
    ffn_dim=13824,
    num_layers=2,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    eps=1e-6,
)
WAN_TINY = dict(num_attention_heads=3, attention_head_dim=12, in_channels=4, out_channels=4, num_layers=1)
WAN_CONFIG = {
    "full": WAN_FULL,
    "quick": {**WAN_FULL, **WAN_TINY, "text_dim": 16, "freq_dim": 16, "ffn_dim": 16, "rope_max_seq_len": 32},
}
WAN_LATENT = {"full": (21, 60, 104), "quick": (2, 4, 4)}  # latent frames, height, width
WAN_TEXT = {"full": 512, "quick": 5}

# Flux 2 [dev]'s widths (Flux2Transformer2DModel's defaults) with 1 double- and 6 single-stream blocks
FLUX2_FULL = dict(
    patch_size=1,
    in_channels=128,
    num_layers=1,
    num_single_layers=6,
    attention_head_dim=128,
    num_attention_heads=48,
    joint_attention_dim=15360,
    timestep_guidance_channels=256,
    mlp_ratio=3.0,
    axes_dims_rope=(32, 32, 32, 32),
    rope_theta=2000,
    guidance_embeds=True,
)
FLUX2_CONFIG = {
    "full": FLUX2_FULL,
    "quick": {
        **FLUX2_FULL,
        **FLUX_TINY,
        "joint_attention_dim": 32,
        "timestep_guidance_channels": 16,
        "axes_dims_rope": (4, 4, 4, 4),
    },
}
FLUX2_TOKENS = {"full": (64, 64, 512), "quick": (4, 4, 8)}  # image grid rows, columns; text tokens

# LTX-2's widths (the 19B audio-video transformer; LTX2VideoTransformer3DModel's defaults but the
# rope type, "split" in the released model) with 4 blocks
LTX2_FULL = dict(
    in_channels=128,
    out_channels=128,
    num_attention_heads=32,
    attention_head_dim=128,
    cross_attention_dim=4096,
    audio_in_channels=128,
    audio_out_channels=128,
    audio_num_attention_heads=32,
    audio_attention_head_dim=64,
    audio_cross_attention_dim=2048,
    num_layers=4,
    qk_norm="rms_norm_across_heads",
    caption_channels=3840,
    rope_type="split",
)
LTX2_CONFIG = {
    "full": LTX2_FULL,
    "quick": {
        **LTX2_FULL,
        "in_channels": 4,
        "out_channels": 4,
        "num_attention_heads": 2,
        "attention_head_dim": 8,
        "cross_attention_dim": 16,
        "audio_in_channels": 4,
        "audio_out_channels": 4,
        "audio_num_attention_heads": 2,
        "audio_attention_head_dim": 4,
        "audio_cross_attention_dim": 8,
        "num_layers": 1,
        "caption_channels": 16,
    },
}
# latent frames, height, width (121 frames at 512 x 768: (121 - 1) / 8 + 1, 512 / 32, 768 / 32);
# audio latent frames (121 / 24 s at 16 kHz, hop 160, 4x: 25 per second); text tokens
LTX2_TOKENS = {"full": ((16, 16, 24), 126, 1024), "quick": ((2, 3, 4), 5, 6)}

# HunyuanVideo 1.5's widths (HunyuanVideo15Transformer3DModel's defaults: the 8.3B 480p model) with 2
# blocks
HV15_FULL = dict(
    in_channels=65,
    out_channels=32,
    num_attention_heads=16,
    attention_head_dim=128,
    num_layers=2,
    num_refiner_layers=2,
    mlp_ratio=4.0,
    patch_size=1,
    patch_size_t=1,
    qk_norm="rms_norm",
    text_embed_dim=3584,
    text_embed_2_dim=1472,
    image_embed_dim=1152,
    rope_theta=256.0,
    rope_axes_dim=(16, 56, 56),
)
HV15_CONFIG = {
    "full": HV15_FULL,
    "quick": {
        **HV15_FULL,
        "in_channels": 9,
        "out_channels": 4,
        "num_attention_heads": 2,
        "attention_head_dim": 16,
        "num_layers": 1,
        "num_refiner_layers": 1,
        "text_embed_dim": 16,
        "text_embed_2_dim": 8,
        "image_embed_dim": 8,
        "rope_axes_dim": (4, 6, 6),
    },
}
# latent frames, height, width (61 frames at 480 x 848: (61 - 1) / 4 + 1, 480 / 16, 848 / 16); the
# pipeline's text slots (Qwen2.5-VL 1000, ByT5 256, SigLIP image 729) and how many of each are valid
# (a prompt of 256 tokens, no glyph text, text-to-video: no image)
HV15_TOKENS = {"full": ((16, 30, 53), (1000, 256, 729), (256, 0)), "quick": ((2, 3, 4), (6, 4, 3), (4, 0))}

# DINOv3 ViT-L/16's widths (transformers' DINOv3ViTConfig) with 4 layers. LayerScale starts at the
# class's 1.0, not the checkpoints' 1e-5 training init: with random weights at 1e-5 the attention
# (and the rotation in it) would add ~1e-5 of the output, below the parity check's resolution. No
# random rescaling of the patch coordinates in training mode (pos_embed_rescale None): each step
# would draw its own angles, and the variants could not be compared.
DINOV3_FULL = dict(
    hidden_size=1024,
    intermediate_size=4096,
    num_attention_heads=16,
    num_hidden_layers=4,
    num_register_tokens=4,
    patch_size=16,
    layerscale_value=1.0,
    rope_theta=100.0,
    pos_embed_rescale=None,
)
DINOV3_CONFIG = {
    "full": DINOV3_FULL,
    "quick": {**DINOV3_FULL, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2,
              "num_hidden_layers": 1, "patch_size": 4},
}  # fmt: skip
DINOV3_INPUT = {"full": (32, 512), "quick": (2, 16)}  # batch, image side in pixels

# Qwen3-8B's widths (transformers' Qwen3Config) with 4 layers
QWEN3_FULL = dict(
    vocab_size=151936,
    hidden_size=4096,
    intermediate_size=12288,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    num_hidden_layers=4,
    max_position_embeddings=40960,
    rope_theta=1e6,
    rms_norm_eps=1e-6,
)
QWEN3_CONFIG = {
    "full": QWEN3_FULL,
    "quick": {**QWEN3_FULL, "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 8, "num_hidden_layers": 1, "max_position_embeddings": 64},
}  # fmt: skip
QWEN3_TOKENS = {"full": (2, 4096), "quick": (2, 8)}  # batch, sequence length

SCHEDULE = {"full": dict(warmup=3, steps=10, rounds=2), "quick": dict(warmup=1, steps=2, rounds=1)}
LOSS_RTOL = {torch.bfloat16: 8e-3, torch.float32: 1e-5}  # about one rounding of the dtype
OUTPUT_SLACK = {torch.bfloat16: 1e-3, torch.float32: 1e-5}  # added to 1.5x the unpatched error
STEPS = ("train", "infer")


# ---------------------------------------------------------------------------------------------
# models and inputs


def cast_params(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """Floating parameters to dtype except those of the class's `_keep_in_fp32_modules` (float32),
    as diffusers' from_pretrained(torch_dtype=dtype) loads them; buffers are left as built."""
    keep = getattr(model, "_keep_in_fp32_modules", None) or []
    for name, p in model.named_parameters():
        if p.is_floating_point():
            p.data = p.data.to(torch.float32 if any(k in name.split(".") for k in keep) else dtype)
    return model


def build(make: Callable[[], torch.nn.Module], device, dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    """A random-weight model made on the device (seeded), its parameters cast, in training mode."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = make()
    return cast_params(model, dtype).train()


def floats(tensors: dict, device, dtype) -> dict:
    return {k: v.to(device, dtype) for k, v in tensors.items()}


def flux_inputs(cfg: dict, tokens, device, dtype, gen: torch.Generator) -> dict:
    """Flux's forward arguments: packed latent patches, T5 states, CLIP pooled vector, timestep,
    and the position ids the Flux pipeline builds ((0, row, column) per patch, zeros for text)."""
    rows, cols, n_txt = tokens
    r, c = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
    img_ids = torch.stack((torch.zeros_like(r), r, c), -1).reshape(-1, 3).float()
    inputs = floats(
        dict(
            hidden_states=torch.randn(1, rows * cols, cfg["in_channels"], generator=gen),
            encoder_hidden_states=torch.randn(1, n_txt, cfg["joint_attention_dim"], generator=gen),
            pooled_projections=torch.randn(1, cfg["pooled_projection_dim"], generator=gen),
        ),
        device,
        dtype,
    )
    inputs["timestep"] = torch.rand(1, generator=gen).to(device, dtype)  # the pipeline's t / 1000
    inputs["img_ids"] = img_ids.to(device)
    inputs["txt_ids"] = torch.zeros(n_txt, 3, device=device)
    return inputs


def flux2_inputs(cfg: dict, tokens, device, dtype, gen: torch.Generator) -> dict:
    """Flux 2's forward arguments: packed latent patches, Mistral states, timestep / 1000, the
    guidance scale, and the (t, h, w, l) ids the Flux 2 pipeline builds: (0, row, column, 0) per
    patch, (0, 0, 0, index) per text token."""
    rows, cols, n_txt = tokens
    r, c = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
    zeros = torch.zeros_like(r)
    img_ids = torch.stack((zeros, r, c, zeros), -1).reshape(1, -1, 4)
    txt_ids = torch.zeros(1, n_txt, 4, dtype=torch.long)
    txt_ids[..., 3] = torch.arange(n_txt)
    inputs = floats(
        dict(
            hidden_states=torch.randn(1, rows * cols, cfg["in_channels"], generator=gen),
            encoder_hidden_states=torch.randn(1, n_txt, cfg["joint_attention_dim"], generator=gen),
        ),
        device,
        dtype,
    )
    inputs["timestep"] = torch.rand(1, generator=gen).to(device, dtype)
    inputs["guidance"] = torch.full((1,), 4.0, device=device)
    inputs["img_ids"] = img_ids.to(device)
    inputs["txt_ids"] = txt_ids.to(device)
    return inputs


def wan_inputs(cfg: dict, latent, n_txt: int, device, dtype, gen: torch.Generator) -> dict:
    """Wan's forward arguments: a (1, C, frames, height, width) latent, a timestep in [0, 1000),
    umT5 states."""
    return dict(
        hidden_states=torch.randn(1, cfg["in_channels"], *latent, generator=gen).to(device, dtype),
        timestep=(torch.rand(1, generator=gen) * 1000).to(device),
        encoder_hidden_states=torch.randn(1, n_txt, cfg["text_dim"], generator=gen).to(device, dtype),
    )


def ltx2_inputs(cfg: dict, tokens, device, dtype, gen: torch.Generator) -> dict:
    """LTX-2's forward arguments as its pipeline passes them: patchified video and audio latents,
    the Gemma connector states of each stream, a timestep in [0, 1000), the latent grid (the model
    builds the RoPE coordinates from it) and the audio latent frames."""
    (frames, height, width), n_audio, n_txt = tokens
    inputs = floats(
        dict(
            hidden_states=torch.randn(1, frames * height * width, cfg["in_channels"], generator=gen),
            audio_hidden_states=torch.randn(1, n_audio, cfg["audio_in_channels"], generator=gen),
            encoder_hidden_states=torch.randn(1, n_txt, cfg["caption_channels"], generator=gen),
            audio_encoder_hidden_states=torch.randn(1, n_txt, cfg["caption_channels"], generator=gen),
        ),
        device,
        dtype,
    )
    inputs["timestep"] = (torch.rand(1, generator=gen) * 1000).to(device, dtype)
    inputs.update(num_frames=frames, height=height, width=width, fps=24.0, audio_num_frames=n_audio)
    return inputs


def hv15_inputs(cfg: dict, tokens, device, dtype, gen: torch.Generator) -> dict:
    """HunyuanVideo 1.5's forward arguments as its text-to-video pipeline passes them: the latent
    with its condition latent and mask channels (zeros: no image), a timestep in [0, 1000), the
    Qwen2.5-VL and ByT5 states with their masks (the first `valid` tokens), and zero image
    embeddings (the model masks them out)."""
    latent, (n_txt, n_txt2, n_img), (valid, valid2) = tokens
    x = torch.zeros(1, cfg["in_channels"], *latent)
    x[:, : (cfg["in_channels"] - 1) // 2] = torch.randn(1, (cfg["in_channels"] - 1) // 2, *latent, generator=gen)
    inputs = floats(
        dict(
            hidden_states=x,
            encoder_hidden_states=torch.randn(1, n_txt, cfg["text_embed_dim"], generator=gen),
            encoder_hidden_states_2=torch.randn(1, n_txt2, cfg["text_embed_2_dim"], generator=gen),
            image_embeds=torch.zeros(1, n_img, cfg["image_embed_dim"]),
        ),
        device,
        dtype,
    )
    inputs["timestep"] = (torch.rand(1, generator=gen) * 1000).to(device, dtype)
    for key, n, v in (("encoder_attention_mask", n_txt, valid), ("encoder_attention_mask_2", n_txt2, valid2)):
        inputs[key] = (torch.arange(n) < v).long()[None].to(device)
    return inputs


def diffusers_forward(model, inputs: dict) -> Sequence[torch.Tensor]:
    """Every output tensor of a diffusers transformer (LTX-2: video and audio)."""
    return [o for o in model(**inputs, return_dict=False) if torch.is_tensor(o)]


def vit_forward(model, inputs: dict) -> Sequence[torch.Tensor]:
    return [model(**inputs).last_hidden_state]


def lm_forward(model, inputs: dict) -> Sequence[torch.Tensor]:
    return [model(**inputs, use_cache=False).last_hidden_state]


def diffusers_case(model: str, cls_name: str, cfg: dict, device, dtype, **fields) -> dict:
    """A diffusers model's case: its class (diffusers imported here, only for the models that are
    run), built from cfg; fields: blocks, tokens, seq_tokens, inputs."""
    import diffusers

    cls = getattr(diffusers, cls_name)
    return dict(
        model=model,
        library="diffusers",
        hidden=cfg["num_attention_heads"] * cfg["attention_head_dim"],
        build=lambda: build(lambda: cls(**cfg), device, dtype),
        **fields,
    )


def joint_image_case(model, cls_name, configs, tokens, blocks, image, make_inputs, size, device, dtype, gen):
    """Flux.1 / Flux 2: double- and single-stream blocks (`blocks` overrides their counts), a grid
    of packed image patches (`image` overrides it) and text tokens through every attention."""
    cfg = dict(configs[size])
    if blocks:
        cfg.update(num_layers=blocks[0], num_single_layers=blocks[1])
    rows, cols, n_txt = tokens[size]
    rows, cols = image or (rows, cols)
    return diffusers_case(
        model,
        cls_name,
        cfg,
        device,
        dtype,
        blocks=f"{cfg['num_layers']} double + {cfg['num_single_layers']} single",
        tokens=f"{rows}x{cols} img + {n_txt} txt",
        seq_tokens=rows * cols + n_txt,
        inputs=make_inputs(cfg, (rows, cols, n_txt), device, dtype, gen),
    )


def flux_case(size: str, device, dtype, gen, args) -> dict:
    flux = ("flux", "FluxTransformer2DModel", FLUX_CONFIG, FLUX_TOKENS, args.flux_blocks, args.flux_image, flux_inputs)
    return joint_image_case(*flux, size, device, dtype, gen)


def flux2_case(size: str, device, dtype, gen, args) -> dict:
    flux2 = ("flux2", "Flux2Transformer2DModel", FLUX2_CONFIG, FLUX2_TOKENS, args.flux2_blocks, args.flux2_image)
    return joint_image_case(*flux2, flux2_inputs, size, device, dtype, gen)


def wan_case(size: str, device, dtype, gen, args) -> dict:
    cfg = dict(WAN_CONFIG[size], **({"num_layers": args.wan_blocks} if args.wan_blocks else {}))
    latent = args.wan_latent or WAN_LATENT[size]
    _, ph, pw = cfg["patch_size"]
    grid = (latent[0], latent[1] // ph, latent[2] // pw)
    return diffusers_case(
        "wan",
        "WanTransformer3DModel",
        cfg,
        device,
        dtype,
        blocks=f"{cfg['num_layers']}",
        tokens=f"{grid[0]}x{grid[1]}x{grid[2]} video (+ {WAN_TEXT[size]} txt, cross)",
        seq_tokens=grid[0] * grid[1] * grid[2],
        inputs=wan_inputs(cfg, latent, WAN_TEXT[size], device, dtype, gen),
    )


def hv15_case(size: str, device, dtype, gen, args) -> dict:
    cfg = dict(HV15_CONFIG[size], **({"num_layers": args.hv15_blocks} if args.hv15_blocks else {}))
    latent, slots, valid = HV15_TOKENS[size]
    latent = args.hv15_latent or latent
    return diffusers_case(
        "hunyuan_video15",
        "HunyuanVideo15Transformer3DModel",
        cfg,
        device,
        dtype,
        blocks=f"{cfg['num_layers']}",
        tokens=f"{latent[0]}x{latent[1]}x{latent[2]} video + {sum(slots)} txt / img slots",
        seq_tokens=latent[0] * latent[1] * latent[2] + sum(slots),
        inputs=hv15_inputs(cfg, (latent, slots, valid), device, dtype, gen),
    )


def ltx2_case(size: str, device, dtype, gen, args) -> dict:
    cfg = dict(LTX2_CONFIG[size], **({"num_layers": args.ltx2_blocks} if args.ltx2_blocks else {}))
    latent, n_audio, n_txt = LTX2_TOKENS[size]
    latent = args.ltx2_latent or latent
    return diffusers_case(
        "ltx2",
        "LTX2VideoTransformer3DModel",
        cfg,
        device,
        dtype,
        blocks=f"{cfg['num_layers']}",
        tokens=f"{latent[0]}x{latent[1]}x{latent[2]} video + {n_audio} audio (+ {n_txt} txt, cross)",
        seq_tokens=latent[0] * latent[1] * latent[2],
        inputs=ltx2_inputs(cfg, (latent, n_audio, n_txt), device, dtype, gen),
    )


def dinov3_case(size: str, device, dtype, gen, args) -> dict:
    from transformers import DINOv3ViTConfig, DINOv3ViTModel

    cfg = dict(DINOV3_CONFIG[size])
    if args.vit_layers:
        cfg.update(num_hidden_layers=args.vit_layers)
    batch, side = DINOV3_INPUT[size]
    batch, side = args.vit_batch or batch, args.vit_image or side
    config = DINOv3ViTConfig(image_size=side, attn_implementation="sdpa", **cfg)
    grid = side // cfg["patch_size"]
    prefix = 1 + cfg["num_register_tokens"]
    return dict(
        model="dinov3",
        library="transformers",
        blocks=f"{cfg['num_hidden_layers']}",
        hidden=cfg["hidden_size"],
        tokens=f"{batch} x ({grid}x{grid} patches + {prefix})",
        seq_tokens=grid * grid + prefix,
        build=lambda: build(lambda: DINOv3ViTModel(config), device, dtype),
        inputs=dict(pixel_values=torch.randn(batch, 3, side, side, generator=gen).to(device, dtype)),
        forward=vit_forward,
    )


def qwen3_case(size: str, device, dtype, gen, args, library: str = "transformers+qknorm") -> dict:
    from transformers import Qwen3Config, Qwen3Model

    cfg = dict(QWEN3_CONFIG[size])
    if args.lm_layers:
        cfg.update(num_hidden_layers=args.lm_layers)
    batch, seq = args.lm_tokens or QWEN3_TOKENS[size]
    config = Qwen3Config(attn_implementation="sdpa", **cfg)
    return dict(
        model="qwen3" if library == "transformers+qknorm" else "qwen3_qkv",
        library=library,
        blocks=f"{cfg['num_hidden_layers']}",
        hidden=cfg["hidden_size"],
        tokens=f"{batch} x {seq}",
        seq_tokens=seq,
        build=lambda: build(lambda: Qwen3Model(config), device, dtype),
        inputs=dict(input_ids=torch.randint(3, cfg["vocab_size"], (batch, seq), generator=gen).to(device)),
        forward=lm_forward,
    )


CASES = {
    "flux": flux_case,
    "wan": wan_case,
    "flux2": flux2_case,
    "hunyuan_video15": hv15_case,
    "ltx2": ltx2_case,
    "dinov3": dinov3_case,
    "qwen3": qwen3_case,
    "qwen3_qkv": lambda size, device, dtype, gen, args: qwen3_case(size, device, dtype, gen, args, "transformers+qkv"),
}


# ---------------------------------------------------------------------------------------------
# the patch of each library


def set_patched(model: torch.nn.Module, library: str, patched: bool) -> dict:
    """Unpatch, then (patched) patch the model with its library's ropekit patch; returns what the
    patch reports: attention modules whose norm + rotation it fuses, rotary helpers / functions
    it replaced."""
    if library == "diffusers":
        import ropekit.diffusers as rd

        rd.unpatch()
        if not patched:
            return {}
        report = rd.patch(model)
        return dict(fused_modules=sum(report.values()), helpers=len(report.helpers))
    import ropekit.hf as rh

    rh.unpatch()
    rh.unfuse_qkv(model)
    if not patched:
        return {}
    if library == "transformers+qkv":  # the whole attention prologue, one rope_qkv_projection call a layer
        return dict(fused_modules=len(rh.fuse_qkv(model, strict=True).fused))
    # "transformers+qknorm": the q / k RMSNorm fused into the rotation as well
    report = rh.patch(model, fuse_qk_norm=library.endswith("+qknorm"))
    fused = {n[: -len(".forward")] for names in report.values() for n in names if n.endswith("Attention.forward")}
    return dict(
        fused_modules=sum(type(m).__name__ in fused for m in model.modules()),
        functions={family: names for family, names in report.items()},
    )


# ---------------------------------------------------------------------------------------------
# one step, timed


def make_step(kind: str, forward: Callable, model, params: List[torch.nn.Parameter], inputs: dict, targets):
    """The step of that kind. train: gradients to None, forward, the float32 MSE of every output
    to its target, summed, backward; returns (loss, outputs detached). infer: the forward under
    torch.inference_mode(); returns (None, outputs)."""
    if kind == "infer":

        def infer():
            with torch.inference_mode():
                return None, list(forward(model, inputs))

        return infer

    def train():
        for p in params:
            p.grad = None
        outs = forward(model, inputs)
        loss = sum(F.mse_loss(o.float(), t) for o, t in zip(outs, targets))
        loss.backward()
        return loss.detach(), [o.detach() for o in outs]

    return train


def timed_steps(step: Callable, n: int, device: torch.device) -> List[float]:
    """Milliseconds of n consecutive steps: CUDA events around each on CUDA, wall clock on CPU."""
    if device.type != "cuda":
        times = []
        for _ in range(n):
            t = time.perf_counter()
            step()
            times.append((time.perf_counter() - t) * 1e3)
        return times
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
    for start, end in events:
        start.record()
        step()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in events]


def grad_norm(params: List[torch.nn.Parameter]) -> float:
    norms = [p.grad.float().norm() for p in params if p.grad is not None]
    return torch.stack(norms).norm().item()


def first_step(step: Callable, device: torch.device, count: bool) -> dict:
    """The first step, wall-timed (compilation included when compiled): its loss and outputs, and
    with count, ropekit's eager rotation calls (all of them, and those with a fused norm weight).
    Every call of ropekit's public rotation ops (apply_rope, rotate_angles, rotate_with_angles)
    goes through one of the rotation's doors (`ropekit.core.dispatch.ROTATE`), whichever
    integration made it."""
    from ropekit.core import dispatch

    real = dict(dispatch.ROTATE)
    calls = {"ropekit_calls": 0, "fused_norm_calls": 0}

    def counting(door):
        def counted(spec, *args, **kwargs):
            out = door(spec, *args, **kwargs)
            if out is not None:  # None: the launch record declined, the spec's door runs the call
                calls["ropekit_calls"] += 1
                calls["fused_norm_calls"] += bool(spec.variant.normed)
            return out

        return counted

    if count:
        for name, door in real.items():
            dispatch.ROTATE[name] = counting(door)
    try:
        sync(device)
        t = time.perf_counter()
        loss, outs = step()
        sync(device)
        first_s = time.perf_counter() - t
    finally:
        dispatch.ROTATE.update(real)
    result = dict(loss=None if loss is None else loss.item(), outputs=outs, first_step_s=first_s)
    return dict(result, **(calls if count else {}))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run_variant(step, params, device, warmup: int, steps: int, first: bool, count: bool, train: bool) -> dict:
    """One variant's turn: (on its first turn, the first step and, training, the gradient norm),
    warmup steps, then timed ones; peak memory over the turn."""
    result: dict = {}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    if first:
        result.update(first_step(step, device, count))
        if train:
            result["grad_norm"] = grad_norm(params)
        warmup -= 1
    for _ in range(max(warmup, 0)):
        step()
    result["step_ms"] = timed_steps(step, steps, device)
    if device.type == "cuda":
        result["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    return result


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def rel_norm(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def compare(unpatched: dict, patched: dict, tol: dict, reference: List[torch.Tensor]) -> dict:
    """The row's numbers from both variants' results: times, and the checks (training: the loss
    within tol's loss_rtol of the unpatched loss; every output's error against the float32
    reference within 1.5x the unpatched output's own plus tol's output_slack). Output figures of a
    model with several outputs (LTX-2: video, audio) are the largest over them."""
    u_ms = statistics.median(unpatched["step_ms"])
    p_ms = statistics.median(patched["step_ms"])
    u_outs, p_outs = unpatched.pop("outputs"), patched.pop("outputs")
    u_err = [rel_norm(o, r) for o, r in zip(u_outs, reference)]
    p_err = [rel_norm(o, r) for o, r in zip(p_outs, reference)]
    row = dict(
        unpatched_ms=u_ms,
        patched_ms=p_ms,
        speedup=u_ms / p_ms,
        loss_unpatched=unpatched["loss"],
        loss_patched=patched["loss"],
        loss_rel_diff=None,
        output_rel_diff=max(rel_norm(p, u) for p, u in zip(p_outs, u_outs)),
        output_err_unpatched=max(u_err),
        output_err_patched=max(p_err),
        **tol,
        loss_ok=None,
        output_ok=len(p_outs) == len(reference)
        and all(p <= 1.5 * u + tol["output_slack"] for p, u in zip(p_err, u_err)),
        ropekit_calls=patched.get("ropekit_calls"),
        fused_norm_calls=patched.get("fused_norm_calls"),
        unpatched=unpatched,
        patched=patched,
    )
    if unpatched["loss"] is not None:
        row["loss_rel_diff"] = rel(patched["loss"], unpatched["loss"])
        row["loss_ok"] = row["loss_rel_diff"] <= tol["loss_rtol"]
        row["grad_norm_rel_diff"] = rel(patched["grad_norm"], unpatched["grad_norm"])
    return row


def measure_eager(kind: str, ctx: dict) -> dict:
    """Unpatched and patched eager turns of one step kind in alternation; the row's numbers."""
    model, library, schedule = ctx["model"], ctx["library"], ctx["schedule"]
    model.train(kind == "train")
    step = make_step(kind, ctx["forward"], model, ctx["params"], ctx["inputs"], ctx["targets"])
    results: Dict[str, dict] = {}
    patch: dict = {}
    for r in range(schedule["rounds"]):
        for name in ("unpatched", "patched"):
            patch = set_patched(model, library, name == "patched") or patch
            turn = run_variant(
                step, ctx["params"], ctx["device"], schedule["warmup"], schedule["steps"], r == 0, True, kind == "train"
            )
            if r == 0:
                results[name] = turn
            else:
                results[name]["step_ms"] += turn["step_ms"]
                if "peak_gib" in turn:
                    results[name]["peak_gib"] = max(results[name]["peak_gib"], turn["peak_gib"])
    set_patched(model, library, False)
    row = compare(results["unpatched"], results["patched"], ctx["tol"], ctx["reference"])
    return dict(row, patched_modules=patch.get("fused_modules", 0), patch=patch)


def measure_compiled(kind: str, ctx: dict) -> dict:
    """torch.compile(model) of each variant (patched before compiling, dynamo reset in between);
    a variant that fails is reported by its error."""
    model, library, schedule = ctx["model"], ctx["library"], ctx["schedule"]
    model.train(kind == "train")
    results: Dict[str, dict] = {}
    for name in ("unpatched", "patched"):
        torch._dynamo.reset()
        set_patched(model, library, name == "patched")
        compiled = torch.compile(model)
        step = make_step(kind, ctx["forward"], compiled, ctx["params"], ctx["inputs"], ctx["targets"])
        try:
            results[name] = run_variant(
                step, ctx["params"], ctx["device"], schedule["warmup"], schedule["steps"], True, False, kind == "train"
            )
        except Exception as e:  # a compile failure is a result: recorded, the run goes on
            return dict(error=f"{name}: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
        finally:
            set_patched(model, library, False)
    torch._dynamo.reset()
    return compare(results["unpatched"], results["patched"], ctx["tol"], ctx["reference"])


def reference_outputs(model: torch.nn.Module, forward: Callable, inputs: dict) -> List[torch.Tensor]:
    """The unpatched model's outputs computed in float32 (a float32 copy of the same weights in
    eval mode, the inputs upcast): the yardstick of both bf16 variants' outputs."""
    ref = cast_params(copy.deepcopy(model), torch.float32).eval()
    up = {k: v.float() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in inputs.items()}
    with torch.no_grad():
        outs = list(forward(ref, up))
    del ref
    return outs


def run_case(case: dict, device, dtype, schedule: dict, tol: dict, steps: Sequence[str], compile_too: bool):
    """The rows of one model: per step kind, the eager row (and the compiled row)."""
    head = {k: case[k] for k in ("model", "blocks", "hidden", "tokens", "seq_tokens")}
    head.update(dtype=str(dtype).replace("torch.", ""), device=str(device), **schedule)
    model = case["build"]()
    head["params_m"] = sum(p.numel() for p in model.parameters()) / 1e6
    forward = case.get("forward", diffusers_forward)
    reference = reference_outputs(model, forward, case["inputs"])
    gen = torch.Generator().manual_seed(2)
    ctx = dict(
        model=model,
        library=case["library"],
        forward=forward,
        params=[p for p in model.parameters() if p.requires_grad],
        inputs=case["inputs"],
        targets=[torch.randn(r.shape, generator=gen).to(device) for r in reference],
        reference=reference,
        device=device,
        schedule=schedule,
        tol=tol,
    )
    rows = []
    for kind in steps:
        rows.append(dict(head, step=kind, mode="eager", **measure_eager(kind, ctx)))
        if compile_too:
            rows.append(dict(head, step=kind, mode="compile", **measure_compiled(kind, ctx)))
    return rows


def release(device: torch.device) -> None:
    """Give a finished model's memory back (an out-of-memory traceback may have held it)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------
# report


def environment(device: torch.device) -> dict:
    """Versions of what ran (diffusers and transformers only when a model of theirs was loaded)."""
    env = dict(torch=torch.__version__, python=platform.python_version())
    for name in ("diffusers", "transformers"):
        version = getattr(sys.modules.get(name), "__version__", None)  # None: not imported by this run
        if version:
            env[name] = version
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        pass
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    try:
        git = ["git", "describe", "--always", "--dirty"]
        env["git"] = subprocess.run(git, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return env


def table(rows: List[dict]) -> str:
    """The markdown table: one line per model, step and mode."""
    lines = [
        "| model | step | mode | blocks | tokens | unpatched ms | patched ms | speedup | loss rel diff | "
        "output rel diff | ropekit calls | peak GiB unpatched / patched |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        where = f"| {r['model']} | {r['step']} | {r['mode']} | {r['blocks']} | {r['tokens']} |"
        if "error" in r:
            lines.append(f"{where} {r['error']} ||||||")
            continue
        peak = "-"
        if "peak_gib" in r["unpatched"]:
            peak = f"{r['unpatched']['peak_gib']:.1f} / {r['patched']['peak_gib']:.1f}"
        loss = "-" if r["loss_rel_diff"] is None else f"{r['loss_rel_diff']:.1e}"
        calls = "-" if r["ropekit_calls"] is None else r["ropekit_calls"]
        lines.append(
            f"{where} {r['unpatched_ms']:.2f} | {r['patched_ms']:.2f} | {r['speedup']:.3f}x | {loss} | "
            f"{r['output_rel_diff']:.1e} | {calls} | {peak} |"
        )
    return "\n".join(lines)


def ints(text: Optional[str]):
    return tuple(int(v) for v in text.split(",")) if text else None


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="JSON file to write")
    p.add_argument("--quick", action="store_true", help="tiny configs, float32, 2 steps (CPU is fine)")
    p.add_argument("--compile", action="store_true", help="also time torch.compile of both variants")
    p.add_argument("--models", default=",".join(CASES), help=f"comma-separated: {', '.join(CASES)}")
    p.add_argument("--step", default=",".join(STEPS), help="comma-separated: train, infer")
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default=None, help="default: bf16 (fp32 with --quick)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per variant and round")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps before each variant's timed ones")
    p.add_argument("--rounds", type=int, default=None, help="unpatched / patched turns, alternated")
    p.add_argument("--flux-blocks", type=ints, default=None, help="Flux double,single blocks (default 2,4)")
    p.add_argument("--flux-image", type=ints, default=None, help="Flux packed-patch grid rows,cols (default 64,64)")
    p.add_argument("--wan-blocks", type=int, default=None, help="Wan blocks (default 2)")
    p.add_argument("--wan-latent", type=ints, default=None, help="Wan latent frames,height,width (default 21,60,104)")
    p.add_argument("--flux2-blocks", type=ints, default=None, help="Flux 2 double,single blocks (default 1,6)")
    p.add_argument("--flux2-image", type=ints, default=None, help="Flux 2 packed-patch grid rows,cols (default 64,64)")
    p.add_argument("--ltx2-blocks", type=int, default=None, help="LTX-2 blocks (default 4)")
    p.add_argument("--ltx2-latent", type=ints, default=None, help="LTX-2 latent frames,height,width (default 16,16,24)")
    p.add_argument("--hv15-blocks", type=int, default=None, help="HunyuanVideo 1.5 blocks (default 2)")
    p.add_argument(
        "--hv15-latent", type=ints, default=None, help="HunyuanVideo 1.5 latent frames,height,width (default 16,30,53)"
    )
    p.add_argument("--vit-layers", type=int, default=None, help="DINOv3 ViT layers (default 4)")
    p.add_argument("--vit-batch", type=int, default=None, help="DINOv3 ViT images per batch (default 32)")
    p.add_argument("--vit-image", type=int, default=None, help="DINOv3 ViT image side in pixels (default 512)")
    p.add_argument("--lm-layers", type=int, default=None, help="Qwen3 layers (default 4)")
    p.add_argument("--lm-tokens", type=ints, default=None, help="Qwen3 batch,sequence length (default 2,4096)")
    p.add_argument("--loss-rtol", type=float, default=None, help="patched vs unpatched loss, relative")
    args = p.parse_args(argv)
    args.models = args.models.split(",")
    args.step = args.step.split(",")
    for flag, given, known in (("--models", args.models, CASES), ("--step", args.step, STEPS)):
        unknown = [v for v in given if v not in known]
        if unknown:
            p.error(f"{flag}: expected names among {', '.join(known)}, got {', '.join(unknown)}")
    return args


def main(argv: Optional[List[str]] = None) -> List[dict]:
    """Run the benchmark; returns the rows (also written to --out as JSON with the environment)."""
    args = parse_args(argv)
    size = "quick" if args.quick else "full"
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype or ("fp32" if args.quick else "bf16")]
    schedule = dict(SCHEDULE[size])
    if device.type == "cuda":
        # cuDNN's fused attention backward failed at these shapes on the H200 (torch 2.11:
        # "mha_graph.execute ... is_good()"), with or without the patch: both variants use the
        # flash / memory-efficient kernels instead, so the comparison stays like for like
        torch.backends.cuda.enable_cudnn_sdp(False)
    for key in schedule:
        if getattr(args, key) is not None:
            schedule[key] = getattr(args, key)
    tol = dict(
        loss_rtol=LOSS_RTOL[dtype] if args.loss_rtol is None else args.loss_rtol, output_slack=OUTPUT_SLACK[dtype]
    )
    rows: List[dict] = []
    for name in args.models:
        case = CASES[name](size, device, dtype, torch.Generator().manual_seed(1), args)
        try:
            rows += run_case(case, device, dtype, schedule, tol, args.step, args.compile)
        except torch.cuda.OutOfMemoryError as e:  # one model too large must not lose the others' rows
            head = dict(model=name, mode="eager", blocks=case["blocks"], tokens=case["tokens"], error=str(e)[:300])
            rows += [dict(head, step=kind) for kind in args.step]
        del case
        release(device)
    print(table(rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(environment=environment(device), size=size, rows=rows), f, indent=1)
    return rows


def failed(rows: List[dict]) -> List[dict]:
    """Rows whose losses or outputs differ beyond the tolerance, eager rows that did not run, and
    eager rows whose patched step made no ropekit call (the patch did nothing for that model; a
    compile failure is a recorded result, not a failure)."""
    bad = [r for r in rows if r.get("loss_ok") is False or r.get("output_ok") is False]
    eager = [r for r in rows if r["mode"] == "eager" and r not in bad]
    return bad + [r for r in eager if "error" in r or not r.get("ropekit_calls")]


if __name__ == "__main__":
    sys.exit(1 if failed(main()) else 0)
