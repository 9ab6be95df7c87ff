"""EP=P reference path over NCCL equals the single-GPU result on the concatenated batch.

Run with:  torchrun --nproc_per_node 2 tests/gpu/ep_reference_nccl.py
Prints one line per check on rank 0 and exits non-zero on a mismatch.
"""

import os
import sys

import torch
import torch.distributed as dist

from mok_nn import MoKMoELayer


def main():
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    H, I, E, K, T = 512, 256, 32, 4, 1000
    torch.manual_seed(0)
    full = MoKMoELayer(H, I, E, K, device="cuda", backend="reference", expert_proj_bias=True)
    sd = full.state_dict()
    ep = MoKMoELayer(H, I, E, K, device="cuda", backend="reference", expert_proj_bias=True, ep_group=dist.group.WORLD)
    per = E // world
    ep.load_state_dict({k: v[rank * per:(rank + 1) * per] if k.startswith("experts.") else v for k, v in sd.items()})
    g = torch.Generator(device="cuda").manual_seed(1)
    xs = torch.randn(world, T, H, device="cuda", generator=g).to(torch.bfloat16)
    dys = torch.randn(world, T, H, device="cuda", generator=g).to(torch.bfloat16)

    def run(layer, x, dy):
        layer.zero_grad(set_to_none=True)
        x = x.clone().requires_grad_()
        y = layer(x)
        y.backward(dy)
        return y.detach(), x.grad, layer.experts.gate_up_proj.grad

    y, dx, dw = run(ep, xs[rank], dys[rank])
    y2, dx2, dw2 = run(ep, xs[rank], dys[rank])
    repeat_ok = torch.equal(y, y2) and torch.equal(dx, dx2) and torch.equal(dw, dw2)
    yf, dxf, dwf = run(full, xs.reshape(-1, H), dys.reshape(-1, H))
    y_ok = torch.equal(y, yf[rank * T:(rank + 1) * T])
    dx_ok = torch.equal(dx, dxf[rank * T:(rank + 1) * T])
    dw_err = ((dw.float() - dwf[rank * per:(rank + 1) * per].float()).norm() / dwf.float().norm()).item()
    results = torch.tensor([repeat_ok, y_ok, dx_ok, dw_err < 1e-2], device="cuda", dtype=torch.int32)
    dist.all_reduce(results, op=dist.ReduceOp.MIN)
    if rank == 0:
        print(f"EP={world} reference over NCCL: bitwise repeat {bool(results[0])}, y equal to EP=1 bitwise "
              f"{bool(results[1])}, dx equal bitwise {bool(results[2])}, dW13 rel err {dw_err:.2e}")
    dist.destroy_process_group()
    sys.exit(0 if bool(results.all()) else 1)


if __name__ == "__main__":
    main()
