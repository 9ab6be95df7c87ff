"""What would a faster router cost, and is it the same function? The layer's routing (router GEMM with fp32 logits,
scores, stable top-k, weights) timed forward+backward beside alternative forms of two of its steps:

  top-k    "keys": torch.topk on unique int64 keys (router.topk_by_keys, the layer's form on CPU: 3x faster there
           than a sort), "sort": the first k of torch.sort(stable=True) (router.topk_by_sort) and, on CUDA,
           "triton": one Triton kernel (triton_ops.topk_indices, the layer's form on CUDA with expert groups).
           The same ids by definition; checked on every run. "fused" (CUDA, no expert groups): the whole routing
           after the GEMM as one Triton kernel each way (triton_ops.route, the layer's form there); scores
           within fp32 rounding, so its ids may differ on near-ties (reported).
  GEMM     "tensor_cores": router.router_logits, the layer's form on CUDA (bf16 products summed in fp32 on the
           tensor cores, forward and backward) against "fp32": x and the router weight cast to fp32, then mm (the
           layer's form on CPU). Not the same bits: the logits' largest difference and the share of tokens whose
           experts change are reported.

    python benchmarks/router_variants.py [--shapes qwen3-30b-a3b,deepseek-v3] [--tokens 8192] [--device cuda]

One JSON line per (shape, variant): fwd / fwd+bwd ms (median of --iters, CUDA events on the GPU), and the checks.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from mok_nn import router as routing
from mok_nn import triton_ops
from mok_nn.bench import SHAPES, _timer

# shape -> routing options of the layer (deepseek-v3: sigmoid scores, 8 groups keep 4, selection bias, scaling)
ROUTING = {
    "qwen3-30b-a3b": dict(score_func="softmax", norm_topk_prob=True),
    "mixtral-8x7b": dict(score_func="softmax", norm_topk_prob=True),
    "deepseek-v3": dict(score_func="sigmoid", norm_topk_prob=True, n_group=8, topk_group=4,
                        routed_scaling_factor=2.5, bias=True),
    "tiny": dict(score_func="softmax", norm_topk_prob=True),
}


TOPK_FORMS = {"keys": routing.topk_by_keys, "sort": routing.topk_by_sort, "triton": triton_ops.topk_indices}


def logits_of(x, weight, gemm: str):
    if gemm == "fp32":
        return x.float() @ weight.float().T
    return routing.router_logits(x, weight)


def route(x, weight, bias, k, opts, gemm: str, topk: str):
    """(ids, weights) of the layer's routing with the GEMM and top-k forms named."""
    logits = logits_of(x, weight, gemm)
    if topk == "fused":
        ids, w, _ = triton_ops.route(logits, k, opts["score_func"], opts["norm_topk_prob"],
                                     opts.get("routed_scaling_factor", 1.0), bias)
        return ids, w
    real = routing.stable_topk_indices
    routing.stable_topk_indices = TOPK_FORMS[topk]
    try:
        ids, w, _ = routing.route_torch(logits, k, opts["score_func"], opts["norm_topk_prob"], opts.get("n_group"),
                                        opts.get("topk_group"), opts.get("routed_scaling_factor", 1.0), bias)
    finally:
        routing.stable_topk_indices = real
    return ids, w


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="qwen3-30b-a3b,deepseek-v3")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    timer = _timer(dev.type)
    failed = 0
    for shape in args.shapes.split(","):
        hidden, _, experts, top_k = SHAPES[shape]
        opts = ROUTING[shape]
        g = torch.Generator(device=dev).manual_seed(0)
        x = torch.randn(args.tokens, hidden, device=dev, generator=g).to(torch.bfloat16).requires_grad_()
        weight = (torch.randn(experts, hidden, device=dev, generator=g) / hidden**0.5).to(torch.bfloat16)
        weight.requires_grad_()
        bias = 0.1 * torch.randn(experts, device=dev, generator=g) if opts.get("bias") else None
        dw = torch.randn(args.tokens, top_k, device=dev, generator=g)
        gemms = ["fp32"] + (["tensor_cores"] if dev.type == "cuda" else [])
        base_ids, _ = route(x, weight, bias, top_k, opts, "fp32", "keys")  # (both forms give these ids)
        base_logits = logits_of(x, weight, "fp32")
        for gemm in gemms:
            forms = ("keys", "sort") + (("triton",) if triton_ops.topk_runs_on(base_logits, top_k) else ())
            if triton_ops.route_runs_on(base_logits, top_k, opts.get("n_group")):
                forms += ("fused",)
            for topk in forms:
                with torch.no_grad():
                    ids, _ = route(x, weight, bias, top_k, opts, gemm, topk)
                    diff = (logits_of(x, weight, gemm) - base_logits).abs().max().item()
                same_ids = bool(torch.equal(ids, base_ids))
                moved = (ids != base_ids).any(dim=1).float().mean().item()

                def fwd():
                    with torch.no_grad():
                        route(x, weight, bias, top_k, opts, gemm, topk)

                def fwd_bwd():
                    _, w = route(x, weight, bias, top_k, opts, gemm, topk)
                    torch.autograd.grad((w * dw).sum(), (x, weight))

                times = {}
                for name, fn in (("fwd", fwd), ("fwd_bwd", fwd_bwd)):
                    for _ in range(5):
                        fn()
                    times[name] = statistics.median(timer(fn) for _ in range(args.iters))
                rec = dict(shape=shape, tokens=args.tokens, gemm=gemm, topk=topk, fwd_ms=round(times["fwd"], 4),
                           fwd_bwd_ms=round(times["fwd_bwd"], 4), same_ids_as_layer=same_ids,
                           tokens_with_other_experts=round(moved, 6), logits_max_abs_diff=diff, device=str(dev),
                           torch=torch.__version__)
                print(json.dumps(rec), flush=True)
                if gemm == "fp32" and topk != "fused" and not same_ids:  # the top-k forms must agree exactly
                    failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
