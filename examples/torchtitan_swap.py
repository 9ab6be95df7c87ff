"""torchtitan: run the routed experts of torchtitan MoE blocks on mok_nn.

Builds a torchtitan MoE block from its config (no downloads), swaps its routed
experts for mok_nn with `swap_moe`, and compares output and gradients with
torchtitan's own block. Router, shared experts, load-balancing state and
parameter names stay torchtitan's, so checkpoints load unchanged.
Needs torchtitan (0.3): pip install torchtitan (its MoE module imports triton).

    PYTHONPATH=$PWD python examples/torchtitan_swap.py [--device cpu]
"""

import argparse
import copy

import torch
from torchtitan.models.common.feed_forward import FeedForward
from torchtitan.models.common.linear import Linear
from torchtitan.models.common.moe import GroupedExperts, MoE, RoutedExperts, TokenChoiceTopKRouter
from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher

from mok_nn.integrations.torchtitan import swap_moe


def tiny_moe(dim=64, hidden=32, experts=8, top_k=2):
    def lin(i, o):
        return Linear.Config(in_features=i, out_features=o)

    config = MoE.Config(
        num_experts=experts,
        routed_experts=RoutedExperts.Config(
            inner_experts=GroupedExperts.Config(dim=dim, hidden_dim=hidden, num_experts=experts),
            token_dispatcher=LocalTokenDispatcher.Config(num_experts=experts, top_k=top_k)),
        router=TokenChoiceTopKRouter.Config(num_experts=experts, gate=lin(dim, experts), top_k=top_k,
                                            score_func="sigmoid", route_norm=True),
        shared_experts=FeedForward.Config(w1=lin(dim, hidden), w2=lin(hidden, dim), w3=lin(dim, hidden)))
    torch.manual_seed(0)
    block = config.build()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, p.shape[-1] ** -0.5)
    return block


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)

    reference = tiny_moe().to(args.device).train()
    block = swap_moe(copy.deepcopy(reference))
    assert list(block.state_dict()) == list(reference.state_dict())

    x = torch.randn(2, 16, 64, device=args.device)
    outs = []
    for m in (reference, block):
        y = m(x)
        y.square().mean().backward()
        outs.append((y.detach(), m.routed_experts.inner_experts.w1_EFD.grad))
    (y_ref, g_ref), (y, g) = outs
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    print(f"relative difference to torchtitan (both bf16 experts): output {rel(y, y_ref):.2e}, "
          f"w1 gradient {rel(g, g_ref):.2e}")
    print(f"tokens per expert (torchtitan's load-balancing counter): {block.tokens_per_expert_E.tolist()}")
    return rel(y, y_ref), rel(g, g_ref)


if __name__ == "__main__":
    main()
