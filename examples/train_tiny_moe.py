"""Train a tiny MoE transformer language model with MoKMoELayer.

The task is generated: each sequence is a random prefix followed by the
prefix reversed; the loss is measured on the reversed half, which a model can
only get right by attending back to the prefix. Runs on CPU by default (a GPU
when present), prints a progress bar with the loss and tokens/s, and finishes
by training a second time with the same seed and checking that the two loss
curves are bitwise identical.

    python examples/train_tiny_moe.py                # defaults: well under a minute on 2 CPU cores
    python examples/train_tiny_moe.py --steps 50 --no-repeat
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

# cuBLAS needs a fixed workspace for deterministic results (set before CUDA starts)
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch
from torch import nn

from mok_nn import MoKMoELayer


class Block(nn.Module):
    def __init__(self, dim, heads, num_experts, top_k, expert_dim, device, dtype):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, device=device, dtype=dtype)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True, device=device, dtype=dtype)
        self.norm2 = nn.LayerNorm(dim, device=device, dtype=dtype)
        self.moe = MoKMoELayer(
            hidden_size=dim, intermediate_size=expert_dim, num_experts=num_experts, top_k=top_k,
            aux_loss_coef=0.01, device=device, dtype=dtype,
        )

    def forward(self, x, causal_mask):
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=causal_mask, need_weights=False)[0]
        return x + self.moe(self.norm2(x))


class TinyMoELM(nn.Module):
    def __init__(self, vocab, seq_len, dim=64, layers=2, heads=4, num_experts=8, top_k=2, expert_dim=64,
                 device=None, dtype=torch.float32):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, device=device, dtype=dtype)
        self.pos = nn.Parameter(torch.randn(seq_len, dim, device=device, dtype=dtype) * 0.02)
        self.blocks = nn.ModuleList(
            Block(dim, heads, num_experts, top_k, expert_dim, device, dtype) for _ in range(layers)
        )
        self.norm = nn.LayerNorm(dim, device=device, dtype=dtype)
        self.head = nn.Linear(dim, vocab, bias=False, device=device, dtype=dtype)
        mask = torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool, device=device), diagonal=1)
        self.register_buffer("causal_mask", mask)

    def forward(self, tokens):
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x, self.causal_mask[: tokens.shape[1], : tokens.shape[1]])
        return self.head(self.norm(x))

    def aux_loss(self):
        return sum(b.moe.aux_loss for b in self.blocks)


def make_batch(generator, batch, half, vocab, device):
    """Random prefix of `half` tokens, then the prefix reversed."""
    prefix = torch.randint(1, vocab, (batch, half), generator=generator)
    seq = torch.cat([prefix, prefix.flip(1)], dim=1)
    return seq.to(device)


def _on_tty() -> bool:
    isatty = getattr(sys.stdout, "isatty", None)
    return bool(isatty and isatty())


def progress(step, steps, loss, tok_per_s, width=30):
    """On a terminal one bar redrawn in place (carriage return); elsewhere (a log file, a pipe) a line
    per update."""
    filled = int(width * step / steps)
    bar = "#" * filled + "." * (width - filled)
    line = f"  [{bar}] step {step:4d}/{steps}  loss {loss:.4f}  {tok_per_s:8.0f} tok/s"
    sys.stdout.write("\r" + line if _on_tty() else line + "\n")
    sys.stdout.flush()


def train(args, device, verbose=True):
    torch.manual_seed(args.seed)
    data_gen = torch.Generator().manual_seed(args.seed + 1)
    half = args.seq_len // 2
    model = TinyMoELM(args.vocab, args.seq_len, num_experts=args.experts, top_k=args.top_k, device=device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    losses = []
    tokens_seen, start = 0, time.perf_counter()
    for step in range(1, args.steps + 1):
        seq = make_batch(data_gen, args.batch, half, args.vocab, device)
        logits = model(seq[:, :-1])
        # predict the reversed half only: positions half-1 .. seq_len-2 predict tokens half .. seq_len-1
        pred = logits[:, half - 1 :].reshape(-1, args.vocab)
        target = seq[:, half:].reshape(-1)
        loss = nn.functional.cross_entropy(pred, target)
        opt.zero_grad(set_to_none=True)
        (loss + model.aux_loss()).backward()
        opt.step()
        losses.append(loss.item())
        tokens_seen += seq.numel()
        if verbose and (step % 5 == 0 or step == args.steps):
            progress(step, args.steps, sum(losses[-5:]) / len(losses[-5:]), tokens_seen / (time.perf_counter() - start))
    if verbose and _on_tty():
        sys.stdout.write("\n")  # end the redrawn bar's line
    return losses, tokens_seen / (time.perf_counter() - start)


def _check_args(parser, args) -> torch.device:
    """argparse errors naming the argument for values the run cannot use; returns the device."""
    if args.steps < 2:
        parser.error(f"--steps must be at least 2 (the loss of the first and last steps is compared), got {args.steps}")
    if args.batch < 1:
        parser.error(f"--batch must be at least 1, got {args.batch}")
    if args.seq_len < 2 or args.seq_len % 2:
        parser.error(f"--seq-len must be even and at least 2, got {args.seq_len}")
    if args.vocab < 2:
        parser.error(f"--vocab must be at least 2 (token 0 is never generated), got {args.vocab}")
    if args.experts < 1:
        parser.error(f"--experts must be at least 1, got {args.experts}")
    if not 1 <= args.top_k <= args.experts:
        parser.error(f"--top-k must be between 1 and --experts ({args.experts}), got {args.top_k}")
    if not math.isfinite(args.lr) or args.lr <= 0:
        parser.error(f"--lr must be a positive number, got {args.lr}")
    try:
        device = torch.device(args.device)
        torch.empty(1, device=device)
    except (RuntimeError, AssertionError, ValueError) as err:
        parser.error(f"--device {args.device!r} cannot be used: {str(err).splitlines()[0] if str(err) else err}")
    return device


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=24)
    p.add_argument("--vocab", type=int, default=16)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--no-repeat", action="store_true", help="skip the second run and the determinism check")
    args = p.parse_args(argv)
    device = _check_args(p, args)
    torch.use_deterministic_algorithms(True)
    print(f"mok_nn tiny MoE LM: {args.experts} experts, top-{args.top_k}, device {device}, {args.steps} steps")
    losses, tps = train(args, device)
    n = min(10, args.steps // 2)   # the first and the last n steps do not overlap
    first, last = sum(losses[:n]) / n, sum(losses[-n:]) / n
    print(f"loss: first {n} steps {first:.4f} -> last {n} steps {last:.4f}   ({tps:.0f} tokens/s)")
    ok = last < first
    if not ok:
        print("FAIL: the loss did not go down")
    if not args.no_repeat:
        print("second run with the same seed, for the determinism check:")
        again, _ = train(args, device)
        same = losses == again
        print("loss curves bitwise identical across two runs:", "yes" if same else "NO")
        ok = ok and same
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
