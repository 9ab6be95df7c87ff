"""Expert parallelism on CUDA (symmetric memory + CuTe DSL kernels) on 2+ GPUs of one host.

Run with:  torchrun --nproc_per_node 2 tests/gpu/ep_cuda_check.py
Checks, each printed as one line by rank 0, exit status non-zero if any fails:
  - layer(backend="cuda", EP=P) against layer(backend="reference", EP=P over NCCL): y and every
    gradient within bf16 rounding (rel L2 < 2e-2), outputs poisoned first (NaN never passes)
  - bitwise identical across runs
  - EP=P results against the single-GPU CUDA path on the concatenated batch: bitwise? (reported)
  - capacity overflow -> NaN outputs and EPError, and the next step works again
  - a peer that never signals -> the barrier returns within its timeout with the error flag set
  - workspace shapes that differ across ranks -> ValueError on every rank
"""

import os
import sys
import time
import traceback

import torch
import torch.distributed as dist

import layer_runs
from layer_runs import GRAD_NAMES
from mok_nn import MoKConfig, MoKMoELayer, cuda_ep, functional

RESULTS = []


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def report(name, ok, detail=""):
    flag = torch.tensor([1 if ok else 0], device="cuda", dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    ok = bool(flag.item())
    RESULTS.append(ok)
    if dist.get_rank() == 0:
        print(f"{'PASS' if ok else 'FAIL'}  {name}  {detail}", flush=True)


def check(name, fn):
    try:
        fn()
    except Exception:  # one failing check must not hide the others
        detail = traceback.format_exc().strip().splitlines()
        print(f"[rank {dist.get_rank()}] {name} raised:\n" + "\n".join(detail[-12:]), flush=True)
        report(name, False, "raised")


def run_layer(layer, x, dy):
    """{name: tensor} of layer_runs.run_layer (torchrun puts tests/gpu on sys.path)."""
    return dict(zip(GRAD_NAMES, layer_runs.run_layer(layer, x, dy)))


def shard(sd, rank, per):
    return {k: v[rank * per:(rank + 1) * per] if k.startswith("experts.") else v for k, v in sd.items()}


def case_vs_reference(name, H, I, E, K, T_by_rank, opts):
    rank, world = dist.get_rank(), dist.get_world_size()
    T = T_by_rank[rank]
    torch.manual_seed(0)  # same full model on every rank
    full = MoKMoELayer(H, I, E, K, device="cuda", backend="cuda", **opts)
    sd = full.state_dict()
    per = E // world
    layers = {}
    for backend in ("cuda", "reference"):
        lay = MoKMoELayer(H, I, E, K, device="cuda", backend=backend, ep_group=dist.group.WORLD, **opts)
        lay.load_state_dict(shard(sd, rank, per))
        layers[backend] = lay
    g = torch.Generator(device="cuda").manual_seed(100 + rank)
    x = torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16)
    dy = torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16)
    got = run_layer(layers["cuda"], x, dy)
    again = run_layer(layers["cuda"], x, dy)
    want = run_layer(layers["reference"], x, dy)
    errs = {k: rel(got[k], want[k]) for k in want}
    ok = all(e < 2e-2 for e in errs.values()) and not any(torch.isnan(v).any() for v in got.values())
    report(f"{name}: EP={world} cuda vs reference", ok, " ".join(f"{k} {v:.1e}" for k, v in errs.items()))
    report(f"{name}: bitwise identical across runs", all(torch.equal(got[k], again[k]) for k in got))

    # EP=P vs the single-GPU CUDA path on all ranks' tokens (every rank runs it locally)
    Ts = T_by_rank
    xs, dys = [], []
    for r in range(world):
        gr = torch.Generator(device="cuda").manual_seed(100 + r)
        xs.append(torch.randn(Ts[r], H, device="cuda", generator=gr).to(torch.bfloat16))
        dys.append(torch.randn(Ts[r], H, device="cuda", generator=gr).to(torch.bfloat16))
    one = run_layer(full, torch.cat(xs), torch.cat(dys))
    lo = sum(Ts[:rank])
    pieces = {"y": one["y"][lo:lo + T], "dx": one["dx"][lo:lo + T],
              "dW13": one["dW13"][rank * per:(rank + 1) * per], "dW2": one["dW2"][rank * per:(rank + 1) * per]}
    if "db13" in one:
        pieces.update(db13=one["db13"][rank * per:(rank + 1) * per], db2=one["db2"][rank * per:(rank + 1) * per])
    same = {k: torch.equal(got[k], v) for k, v in pieces.items()}
    errs1 = {k: rel(got[k], v) for k, v in pieces.items()}
    # informational: reported, not a pass/fail criterion beyond closeness
    report(f"{name}: EP={world} vs EP=1 (cuda) close", all(e < 2e-2 for e in errs1.values()),
           "bitwise equal: " + " ".join(f"{k}={v}" for k, v in same.items()))
    ws = layers["cuda"]
    wsp = functional.get_workspace(hidden_size=H, intermediate_size=I, num_experts=E, top_k=K,
                                   ep_group=dist.group.WORLD, device=x.device, dtype=x.dtype, backend="cuda",
                                   activation=ws.activation, swiglu_limit=ws.swiglu_limit, config=ws.config)
    if rank == 0:
        print(f"      workspace {wsp.nbytes / 2**20:.1f} MiB (symmetric buffer, token capacity "
              f"{wsp.ep_state['bufs'].tokens_cap})", flush=True)


def case_overflow():
    rank = dist.get_rank()
    H, I, E, K, T = 256, 128, 16, 2, 600
    cfg = MoKConfig(schedule_capacity_multiplier=1.0)
    torch.manual_seed(1)
    lay = MoKMoELayer(H, I, E, K, device="cuda", backend="cuda", ep_group=dist.group.WORLD, config=cfg,
                      router_bias=True)
    g = torch.Generator(device="cuda").manual_seed(7 + rank)
    x = torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16)
    ws = functional.get_workspace(hidden_size=H, intermediate_size=I, num_experts=E, top_k=K,
                                  ep_group=dist.group.WORLD, device=x.device, dtype=x.dtype, backend="cuda",
                                  config=cfg)
    with torch.no_grad():
        lay.router.bias.zero_()
        y_ok = lay(x)
    cuda_ep.check_errors(ws)  # balanced routing: no error
    with torch.no_grad():
        lay.router.bias[:K] = 50.0  # every token of every rank picks experts 0..K-1, all on rank 0
        t0 = time.time()
        y_bad = lay(x)
    raised = ""
    try:
        cuda_ep.check_errors(ws)
    except cuda_ep.EPError as err:
        raised = str(err)
    elapsed = time.time() - t0
    report("overflow: outputs NaN and EPError raised", bool(torch.isnan(y_bad).all()) and "overflowed" in raised,
           f"({elapsed:.2f} s) {raised[:90]}...")
    with torch.no_grad():
        lay.router.bias.zero_()
        y_again = lay(x)
    cuda_ep.check_errors(ws)
    report("overflow: the next step works and repeats bitwise", torch.equal(y_ok, y_again))


def case_peer_timeout():
    rank = dist.get_rank()
    bufs = cuda_ep.SymmBuffers.create(dist.group.WORLD, 8, 64, 2, torch.device("cuda"), timeout_s=0.5)
    t0 = time.time()
    if rank == 0:  # rank 1 never calls the barrier
        bufs.barrier()
        torch.cuda.synchronize()
    elapsed = time.time() - t0
    flag = int(bufs.err.item())
    ok = (flag == 1 and elapsed < 10) if rank == 0 else flag == 0
    report("peer never signals: barrier exits with the error flag", ok, f"rank0 waited {elapsed:.2f} s" if rank == 0 else "")
    dist.barrier()


def case_shapes_differ():
    rank = dist.get_rank()
    try:
        functional.get_workspace(hidden_size=128 + 64 * rank, intermediate_size=64, num_experts=8, top_k=2,
                                 ep_group=dist.group.WORLD, device=torch.device("cuda"), backend="cuda")
        msg = ""
    except ValueError as err:
        msg = str(err)
    report("shapes differing across ranks rejected", "hidden_size: [128, 192]" in msg, msg[:100])


def case_auto_picks_cuda():
    lay = MoKMoELayer(128, 64, 8, 2, device="cuda", backend="auto", ep_group=dist.group.WORLD)
    x = torch.randn(4, 128, device="cuda").to(torch.bfloat16)
    report("backend='auto' with EP picks the CUDA kernels", lay._choose_backend(x) == "cuda")


def main():
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    check("auto", case_auto_picks_cuda)
    check("default", lambda: case_vs_reference("swiglu", 512, 256, 32, 4, [1000, 777], {}))
    check("oai", lambda: case_vs_reference(
        "swiglu_oai+bias", 256, 128, 16, 4, [300, 301], dict(activation="swiglu_oai", swiglu_limit=7.0,
                                                               expert_proj_bias=True)))
    check("grouped", lambda: case_vs_reference(
        "sigmoid/groups/shared", 384, 192, 16, 4, [257, 1], dict(score_func="sigmoid", n_group=4, topk_group=2,
                                                                use_expert_bias=True, routed_scaling_factor=2.5,
                                                                shared_intermediate_size=64)))
    check("overflow", case_overflow)
    check("shapes", case_shapes_differ)
    check("timeout", case_peer_timeout)  # last: leaves its own buffers out of step
    dist.barrier()
    if rank == 0:
        print(f"{sum(RESULTS)}/{len(RESULTS)} checks passed", flush=True)
    dist.destroy_process_group()
    sys.exit(0 if all(RESULTS) else 1)


if __name__ == "__main__":
    main()
