"""Train a Hugging Face model with ropekit's RoPE: patch, check against HF, one optimizer step.

    python examples/hf_training.py

A tiny Llama with random weights is built from a config (nothing is downloaded). `ropekit.hf.patch`
swaps transformers' rotary functions for ropekit's; the logits and every parameter gradient then
match the unpatched model, and training proceeds as usual. On a GPU the Triton kernels run; on
CPU, ropekit's PyTorch path.
"""

import torch
import transformers
from rope_math import check

import ropekit.hf


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    model = transformers.LlamaForCausalLM(config).to(device).train()
    ids = torch.randint(0, config.vocab_size, (2, 32), device=device)

    def loss_and_grads():
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    hf_logits, hf_grads = loss_and_grads()  # transformers' own RoPE

    # strict=True: a rotary function the model calls that ropekit cannot take raises here, naming it
    # and why, instead of leaving HF's math in place (which would make the comparison below HF vs HF)
    patched = ropekit.hf.patch(model, strict=True)  # {family: [replaced functions]}
    if not patched:
        raise SystemExit(
            f"ropekit.hf.patch replaced nothing in this model: {patched.left} (transformers "
            f"{transformers.__version__}; see docs/hf.md for the supported range)"
        )
    print("patched:", dict(patched), "binding:", patched.routes)
    logits, grads = loss_and_grads()
    check("logits", logits, hf_logits, 1e-5)
    worst = max(check(name, grads[name], hf_grads[name], 1e-4) for name in hf_grads)
    print(f"logits and {len(grads)} gradients match HF (largest relative difference {worst:.2g})")

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    optimizer.step()  # the gradients of the patched model
    loss = model(input_ids=ids, labels=ids).loss
    print(f"one training step on {device}: loss {loss.item():.4f}")
    ropekit.hf.unpatch()


if __name__ == "__main__":
    main()
