"""A training step of a small Qwen3-MoE model on CPU: transformers' default experts vs mok_nn's portable backend.

    PYTHONPATH=. python benchmarks/cpu_small_model.py [--tokens 1024] [--iters 10] [--dtype bf16|fp32]
                                                      [--out docs/benchmarks/NAME.json]

The model: 2 decoder layers, hidden 256, 32 experts of intermediate 128, top-4, built from a config with
random weights. One step = forward of the causal-LM loss, backward, AdamW step, on one batch of `tokens`
tokens. Models with the same initial weights: transformers as it comes (its default experts
implementation, grouped_mm), the same model with its MoE blocks patched by mok_nn
(integrations.huggingface.patch_model, backend="torch"), patched with precision="mxfp8", and the two
patched ones again with frozen routed experts (requires_grad False: the MXFP8 weights are quantised once,
then reused from the cache; the bf16 one is its baseline). The steps rotate between them (A B C .., B C ..
A, ...); the median over `iters` steps is reported, after warm-up steps, with the load average (os.getloadavg)
before and after: the machine may be shared. Before timing, the first loss of each must agree.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import pathlib
import statistics
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from mok_nn import bench  # noqa: E402
from mok_nn.integrations.huggingface import patch_model  # noqa: E402

CONFIG = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_experts=32,
              num_experts_per_tok=4, norm_topk_prob=True, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=64, max_position_embeddings=2048, tie_word_embeddings=False)


def build(dtype):
    import transformers

    config = transformers.Qwen3MoeConfig(**CONFIG)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config).to(dtype)
    with torch.no_grad():  # spread the router logits: no near-ties between the implementations' top-k
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
    return model


def freeze_experts(model):
    """The routed experts' weights without gradients (e.g. fine-tuning around frozen experts)."""
    for name, p in model.named_parameters():
        if ".experts." in name:
            p.requires_grad_(False)
    return model


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--out", default=None)
    ap.add_argument("--impls", default=None,
                    help="comma-separated subset of the implementations (hf_default is always timed)")
    args = ap.parse_args(argv)
    dtype = bench.DTYPES[args.dtype]
    import transformers

    base = build(dtype)
    models = {"hf_default": base,
              "mok_nn_torch": patch_model(copy.deepcopy(base), backend="torch"),
              "mok_nn_torch_mxfp8": patch_model(copy.deepcopy(base), backend="torch", precision="mxfp8"),
              "mok_nn_torch_frozen_experts": freeze_experts(patch_model(copy.deepcopy(base), backend="torch")),
              "mok_nn_torch_mxfp8_frozen_experts": freeze_experts(
                  patch_model(copy.deepcopy(base), backend="torch", precision="mxfp8"))}
    if args.impls:
        keep = {"hf_default", *args.impls.split(",")}
        models = {name: m for name, m in models.items() if name in keep}
    opts = {name: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-4)
            for name, m in models.items()}
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, CONFIG["vocab_size"], (1, args.tokens), generator=g)

    def step(name):
        m, opt = models[name], opts[name]
        opt.zero_grad(set_to_none=True)
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        return loss.detach()

    with torch.no_grad():
        losses = {name: m(input_ids=ids, labels=ids).loss.item() for name, m in models.items()}
    print("first loss:", losses, flush=True)
    ref = losses["hf_default"]
    for name, loss in losses.items():
        assert abs(loss - ref) < (5e-2 if "mxfp8" in name else 2e-2) * abs(ref), losses
    load_before = os.getloadavg()

    for name in models:
        for _ in range(args.warmup):
            step(name)
    times = {name: [] for name in models}
    order = list(models)
    for i in range(args.iters):
        k = i % len(order)
        for name in order[k:] + order[:k]:
            t0 = time.perf_counter()
            step(name)
            times[name].append((time.perf_counter() - t0) * 1e3)
    load = [round(v, 2) for v in load_before + os.getloadavg()]
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    records = [dict(model="qwen3-moe-small", **{k: CONFIG[k] for k in ("hidden_size", "moe_intermediate_size",
                                                                        "num_experts", "num_experts_per_tok",
                                                                        "num_hidden_layers")},
                    tokens=args.tokens, impl=name, dtype=args.dtype, step_ms=round(statistics.median(t), 2),
                    step_ms_all=[round(v, 2) for v in t], threads=torch.get_num_threads(), device="cpu",
                    torch=torch.__version__, transformers=transformers.__version__, commit=bench._commit(), date=date,
                    loadavg_1_5_15min_before_after=load)
               for name, t in times.items()]
    hf = records[0]["step_ms"]
    for r in records:
        r["speed_vs_hf_default"] = round(hf / r["step_ms"], 3)
        print(f"{r['impl']:<34} {r['dtype']} step {r['step_ms']:9.2f} ms  (hf_default / this: {hf / r['step_ms']:.2f}x)")
    print(f"load average (1, 5, 15 min) before {load[:3]}, after {load[3:]}")
    if args.out:
        out = pathlib.Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(records, indent=1) + "\n")
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
