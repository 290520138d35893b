"""Tiny random-weight diffusers transformers and inputs for the ropekit.diffusers tests: BUILDERS
{family: () -> (model, inputs(generator) -> forward kwargs)}, diffusers' own classes, no downloads."""

import torch


def _flux(layers=1):
    from diffusers import FluxTransformer2DModel

    m = FluxTransformer2DModel(
        patch_size=1,
        in_channels=4,
        num_layers=layers,
        num_single_layers=layers,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=8,
        guidance_embeds=False,
        axes_dims_rope=(4, 6, 6),
    )
    S_img, S_txt = 6, 3
    img_ids = torch.stack([torch.zeros(S_img), torch.arange(S_img) // 3, torch.arange(S_img) % 3], -1).float()

    def inputs(g):
        return dict(
            hidden_states=torch.randn(1, S_img, 4, generator=g),
            encoder_hidden_states=torch.randn(1, S_txt, 32, generator=g),
            pooled_projections=torch.randn(1, 8, generator=g),
            timestep=torch.rand(1, generator=g),
            img_ids=img_ids,
            txt_ids=torch.zeros(S_txt, 3),
        )

    return m, inputs


def _wan(layers=1):
    from diffusers import WanTransformer3DModel

    m = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=3,  # not a power of two: the across-heads norm takes any head count
        attention_head_dim=12,
        in_channels=4,
        out_channels=4,
        text_dim=16,
        freq_dim=16,
        ffn_dim=16,
        num_layers=layers,
        rope_max_seq_len=32,
    )

    def inputs(g):
        return dict(
            hidden_states=torch.randn(1, 4, 2, 4, 4, generator=g),
            timestep=torch.rand(1, generator=g) * 1000,
            encoder_hidden_states=torch.randn(1, 5, 16, generator=g),
        )

    return m, inputs


def _hunyuan_video():
    from diffusers import HunyuanVideoTransformer3DModel

    m = HunyuanVideoTransformer3DModel(
        in_channels=4,
        out_channels=4,
        num_attention_heads=2,
        attention_head_dim=16,
        num_layers=1,
        num_single_layers=1,
        num_refiner_layers=1,
        patch_size=1,
        patch_size_t=1,
        guidance_embeds=False,
        text_embed_dim=16,
        pooled_projection_dim=8,
        rope_axes_dim=(4, 6, 6),
    )

    def inputs(g):
        return dict(
            hidden_states=torch.randn(1, 4, 2, 2, 2, generator=g),
            timestep=torch.rand(1, generator=g) * 1000,
            encoder_hidden_states=torch.randn(1, 3, 16, generator=g),
            encoder_attention_mask=torch.ones(1, 3),
            pooled_projections=torch.randn(1, 8, generator=g),
        )

    return m, inputs


def _qwen_image():
    from diffusers import QwenImageTransformer2DModel

    m = QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=8,
        out_channels=4,
        num_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=16,
        axes_dims_rope=(4, 6, 6),
    )

    def inputs(g):
        return dict(
            hidden_states=torch.randn(1, 6, 8, generator=g),
            encoder_hidden_states=torch.randn(1, 3, 16, generator=g),
            encoder_hidden_states_mask=torch.ones(1, 3),
            timestep=torch.rand(1, generator=g),
            img_shapes=[(1, 2, 3)],
        )

    return m, inputs


def _z_image():
    from diffusers import ZImageTransformer2DModel

    m = ZImageTransformer2DModel(
        all_patch_size=(2,), all_f_patch_size=(1,), in_channels=4, dim=16, n_layers=1, n_refiner_layers=1,
        n_heads=2, n_kv_heads=2, qk_norm=True, cap_feat_dim=8, rope_theta=256.0, axes_dims=[4, 2, 2],
        axes_lens=[64, 16, 16],
    )  # fmt: skip

    def inputs(g):
        # two samples of different lengths: per-sample positions (freqs_cis (B, S, D / 2)) and padding
        return dict(
            x=[torch.randn(4, 1, 4, 4, generator=g), torch.randn(4, 1, 4, 6, generator=g)],
            cap_feats=[torch.randn(3, 8, generator=g), torch.randn(5, 8, generator=g)],
            t=torch.tensor([0.3, 0.7]),
        )

    return m, inputs


def _bria_fibo2():
    from diffusers.models.transformers.transformer_bria_fibo2 import BriaFibo2Transformer2DModel

    m = BriaFibo2Transformer2DModel(
        in_channels=4, patch_size=2, dim=32, n_layers=2, n_refiner_layers=1, n_heads=2, cap_feat_dim=16,
        injection_layer_ids=(1,), perceiver_num_layers=1, min_num_gist_tokens=4, max_num_gist_tokens=8, gist_step=4,
        gist_min_text_len=4, gist_max_text_len=16, axes_dims=(8, 4, 4), axes_lens=(64, 16, 16),
    )  # fmt: skip

    def inputs(g):
        return dict(
            hidden_states=torch.randn(1, 4, 4, 4, generator=g),
            timestep=torch.rand(1, generator=g),
            encoder_hidden_states=torch.randn(1, 2, 6, 16, generator=g),  # the Perceiver's bundle + one injection
        )

    return m, inputs


def _hunyuan_video_framepack():
    from diffusers import HunyuanVideoFramepackTransformer3DModel

    m = HunyuanVideoFramepackTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=10, num_layers=1,
        num_single_layers=1, num_refiner_layers=1, patch_size=2, patch_size_t=1, guidance_embeds=True,
        text_embed_dim=16, pooled_projection_dim=8, rope_axes_dim=(2, 4, 4), image_condition_type=None,
        has_image_proj=True, image_proj_dim=16, has_clean_x_embedder=True,
    )  # fmt: skip
    F, S = 2, 3

    def inputs(g):
        return dict(
            hidden_states=torch.randn(1, 4, F, 4, 4, generator=g),
            timestep=torch.tensor([500]),
            encoder_hidden_states=torch.randn(1, S, 16, generator=g),
            pooled_projections=torch.randn(1, 8, generator=g),
            encoder_attention_mask=torch.ones(1, S),
            guidance=torch.tensor([400]),
            image_embeds=torch.randn(1, S, 16, generator=g),
            indices_latents=torch.arange(F).float(),
            latents_clean=torch.randn(1, 4, F - 1, 4, 4, generator=g),
            indices_latents_clean=torch.arange(F - 1).float(),
            latents_history_2x=torch.randn(1, 4, F - 1, 4, 4, generator=g),
            indices_latents_history_2x=torch.arange(F - 1).float(),
            latents_history_4x=torch.randn(1, 4, (F - 1) * 4, 4, 4, generator=g),
            indices_latents_history_4x=torch.arange((F - 1) * 4).float(),
        )

    return m, inputs


BUILDERS = {
    "flux": _flux,
    "wan": _wan,
    "hunyuan_video": _hunyuan_video,
    "qwen_image": _qwen_image,
    "z_image": _z_image,
    "bria_fibo2": _bria_fibo2,
    "hunyuan_video_framepack": _hunyuan_video_framepack,  # HunyuanVideo's blocks and processor
}
FAMILY = {"hunyuan_video_framepack": "hunyuan_video"}  # builder -> the ropekit.diffusers family it runs
