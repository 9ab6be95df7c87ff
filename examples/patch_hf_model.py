"""Patch a transformers MoE model with mok_nn and train it a few steps.

Builds a small random Mixtral from a config (no downloads), patches its MoE
blocks with MoKMoELayer, shows that the logits and the router aux loss are
unchanged, trains a few steps and saves / reloads the model in the original
transformers format.  Runs on CPU in seconds:

    pip install -e . transformers
    python examples/patch_hf_model.py
"""

import argparse
import copy
import sys
import tempfile

import torch

try:
    import transformers
except ImportError:
    sys.exit("patch_hf_model.py needs transformers: pip install transformers")

from mok_nn.integrations.huggingface import MoKHFBlock, patch_model


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    return parser.parse_args(argv)


def main(argv=()):
    """The demo; ``argv`` are command-line arguments (none but --help; main() is the default run)."""
    parse_args(list(argv))
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
        router_aux_loss_coef=0.02)
    original = transformers.MixtralForCausalLM(config).float().eval()

    model = patch_model(copy.deepcopy(original), backend="auto")   # reference path on CPU
    n = sum(isinstance(m, MoKHFBlock) for m in model.modules())
    print(f"patched {n} MoE blocks")

    ids = torch.randint(0, config.vocab_size, (4, 16))
    with torch.no_grad():
        ref = original(ids, labels=ids, output_router_logits=True)
        out = model(ids, labels=ids, output_router_logits=True)
    print(f"max |logits difference| = {(out.logits - ref.logits).abs().max():.2e}")
    print(f"aux loss: original {ref.aux_loss:.6f}, patched {out.aux_loss:.6f}")
    assert torch.allclose(out.logits, ref.logits, rtol=1e-5, atol=1e-5)

    # a few training steps on a fixed batch: the loss (incl. aux loss) goes down
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(8):
        loss = model(ids, labels=ids, output_router_logits=True).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        print(f"step {step}: loss {loss.item():.4f}")
    model.eval()

    # the checkpoint is an ordinary Mixtral checkpoint
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        reloaded = transformers.MixtralForCausalLM.from_pretrained(tmp).float().eval()
    with torch.no_grad():
        diff = (reloaded(ids).logits - model(ids).logits).abs().max()
    print(f"reloaded unpatched model: max |logits difference| = {diff:.2e}")


if __name__ == "__main__":
    main(sys.argv[1:])
