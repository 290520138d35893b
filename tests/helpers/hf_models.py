"""Config keywords of the tiny random-weight transformers models the HF tests build."""

# every causal LM family: 2 layers of 4 query / 2 kv heads, a 64-token vocabulary
TINY_LM = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)

# the parity tests' models (patched against unpatched and float64): 2 layers of 4 query / 2 kv
# heads over hidden 64, weights drawn wide (initializer_range 0.3) so a wrong rotation shows
PARITY_LM = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    initializer_range=0.3,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

# DeepSeek's MLA with a small MoE: rope and nope parts of 8, a kv latent of 16
TINY_MLA = dict(
    moe_intermediate_size=32,
    n_routed_experts=2,
    num_experts_per_tok=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
    q_lora_rank=None,
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=8,
    num_key_value_heads=4,
    experts_implementation="eager",
)
