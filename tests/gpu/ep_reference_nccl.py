"""EP=P reference path over NCCL against the single-GPU result on the concatenated batch.

Run with:  torchrun --nproc_per_node 2 tests/gpu/ep_reference_nccl.py

Two checks:
- routed experts (MoKFunction) given the same routing: y, dx, d topk-weights and
  the local expert gradients must be bitwise equal to EP=1 (the determinism
  stretch goal: results independent of the EP degree);
- the whole layer: within bf16 tolerance (the router GEMM runs over fewer rows per
  rank, and cuBLAS may round a different row count differently).
Prints one line on rank 0 and exits non-zero on a failure.
"""

import os
import sys

import torch
import torch.distributed as dist

from mok_nn import MoKMoELayer, functional, router
from mok_nn.autograd import MoKFunction

from layer_runs import rel_err as _rel  # tests/gpu is sys.path[0] when run as a script


def main():
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    H, I, E, K, T = 512, 256, 32, 4, 1000
    per = E // world
    torch.manual_seed(0)
    opts = dict(device="cuda", backend="reference", expert_proj_bias=True)
    full = MoKMoELayer(H, I, E, K, **opts)
    sd = full.state_dict()
    ep = MoKMoELayer(H, I, E, K, ep_group=dist.group.WORLD, **opts)
    ep.load_state_dict({k: v[rank * per:(rank + 1) * per] if k.startswith("experts.") else v for k, v in sd.items()})
    g = torch.Generator(device="cuda").manual_seed(1)
    xs = torch.randn(world * T, H, device="cuda", generator=g).to(torch.bfloat16)
    dys = torch.randn(world * T, H, device="cuda", generator=g).to(torch.bfloat16)
    mine = slice(rank * T, (rank + 1) * T)

    # 1) routed experts with one routing for both
    with torch.no_grad():
        ids, w, _ = router.route(full.router(xs), K)

    def experts(layer, x, ids, w, dy):
        x = x.clone().requires_grad_()
        w = w.clone().requires_grad_()
        e = layer.experts
        ws = functional.get_workspace(hidden_size=H, intermediate_size=I, num_experts=E, top_k=K,
                                      ep_group=layer.ep_group, device=x.device, dtype=x.dtype)
        params = [p.detach().clone().requires_grad_() for p in (e.gate_up_proj, e.down_proj, e.gate_up_proj_bias,
                                                                  e.down_proj_bias)]
        y = MoKFunction.apply(x, w, *params, ids, ws)
        y.backward(dy)
        return [y.detach(), x.grad, w.grad] + [p.grad for p in params]

    got = experts(ep, xs[mine], ids[mine], w[mine], dys[mine])
    again = experts(ep, xs[mine], ids[mine], w[mine], dys[mine])
    want = experts(full, xs, ids, w, dys)
    want = [t[mine] for t in want[:3]] + [t[rank * per:(rank + 1) * per] for t in want[3:]]
    repeat_ok = all(torch.equal(a, b) for a, b in zip(got, again))
    experts_equal = all(torch.equal(a, b) for a, b in zip(got, want))

    # 2) whole layer, tolerance
    x = xs[mine].clone().requires_grad_()
    ep(x).backward(dys[mine])
    xf = xs.clone().requires_grad_()
    y_full = full(xf)
    y_full.backward(dys)
    with torch.no_grad():
        y_ep = ep(xs[mine])
    layer_err = max(_rel(y_ep, y_full[mine].detach()), _rel(x.grad, xf.grad[mine]))
    results = torch.tensor([repeat_ok, experts_equal, layer_err < 2e-2], device="cuda", dtype=torch.int32)
    dist.all_reduce(results, op=dist.ReduceOp.MIN)
    if rank == 0:
        print(f"EP={world} reference over NCCL: bitwise repeat {bool(results[0])}; routed experts bitwise equal "
              f"to EP=1 given the same routing {bool(results[1])}; whole layer rel err vs EP=1 {layer_err:.2e}")
    dist.destroy_process_group()
    sys.exit(0 if bool(results.all()) else 1)


if __name__ == "__main__":
    main()
