"""transformers 5.x: run a model's routed experts on mok_nn with experts_implementation="mok".

The model keeps its own router, modules and state dict; only the experts
computation goes through mok_nn. A tiny Qwen3-MoE built from a config (no
downloads) trains a few steps with "mok" and is checked against transformers'
default "grouped_mm".

    PYTHONPATH=$PWD python examples/hf_experts_implementation.py [--steps 5] [--device cpu]
"""

import argparse
import copy
import tempfile

import torch
import transformers

import mok_nn.integrations.huggingface  # noqa: F401  (registers experts_implementation="mok")


def tiny_model(dtype):
    config = transformers.Qwen3MoeConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
        num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=128)
    torch.manual_seed(0)
    return transformers.Qwen3MoeForCausalLM(config).to(dtype)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32

    with tempfile.TemporaryDirectory() as path:
        tiny_model(dtype).save_pretrained(path)
        model = transformers.AutoModelForCausalLM.from_pretrained(path, experts_implementation="mok", dtype=dtype)
    model.to(args.device).train()
    reference = copy.deepcopy(model)
    reference.set_experts_implementation("grouped_mm")

    ids = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(1)).to(args.device)
    with torch.no_grad():
        diff = (model(ids).logits.float() - reference(ids).logits.float()).abs().max().item()
    print(f"experts_implementation={model.config._experts_implementation!r}: "
          f"max |logits - grouped_mm logits| = {diff:.2e}")

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(args.steps):
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        print(f"step {step + 1}: loss {losses[-1]:.4f}")
    return diff, losses


if __name__ == "__main__":
    main()
