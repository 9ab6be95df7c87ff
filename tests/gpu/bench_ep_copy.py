"""Diagnostic (not a test): the EP row copies, v1 (mok_ep_copy_rows, one CTA per row, one launch per
peer) against v2 (kernels/ep_copy.py: grid-stride warps, one launch for every peer), on the sequential
EP path's real index sets.

    python tests/gpu/bench_ep_copy.py                                  # one GPU: the "peer" is local memory
    torchrun --nproc_per_node 2 tests/gpu/bench_ep_copy.py             # two GPUs: real NVLink peers
        [--tokens 8192] [--hidden 2048] [--experts 128] [--topk 8] [--iters 20] [--cpsm 1,2,4,8]

Routing: top-k of random logits for every rank (the same ids on every rank), the schedule of
cuda_ep.make_ep_schedule at the default capacity multiplier. Cases (what cuda_ep runs):
  pull       dispatch: the rows of the peer's tokens that this rank needs (forward; the backward runs it
             for x and for dy)
  push_peer  combine push of the rows owned by the peer (grid of v1: all `cap` rows, most -1)
  push_self  the same for the own rank (local copy)
  push_all   both pushes: v1 = P launches, v2 = one mok_ep_push_peers launch
  pull_as_push  the same rows as pull, stored by their owner into the next rank's tokens section
             (a push dispatch, for comparison; cuda_ep does not do this)
Implementations: v1; v2@c = the one-launch kernel (mok_ep_pull_peers / mok_ep_push_peers) with c CTAs per
SM; copy2@c = mok_ep_copy_rows_v2 as a drop-in for the per-peer launches. With two ranks both copy at
the same time, started by a device barrier (mok_ep_signal); an iteration's time is the slower rank's.
Medians; GB/s = bytes of the rows moved / time. Before timing, pull and push_all of v2 are checked
bitwise against v1 (destinations poisoned first). Prints a table; writes bench_ep_copy.json and
bench_ep_copy.txt to $OUT (default /tmp). Runtime: ~10-30 s.
"""

import argparse
import json
import os
import statistics

os.environ.setdefault("MOK_EP_TIMEOUT_S", "20")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from mok_nn import cuda_backend as cb  # noqa: E402
from mok_nn import cuda_ep  # noqa: E402
from mok_nn.config import MoKConfig  # noqa: E402


def _setup(args, distributed):
    P = dist.get_world_size() if distributed else 2
    rank = dist.get_rank() if distributed else 0
    dev = torch.device("cuda", torch.cuda.current_device())
    tc, H, E, K = args.tokens, args.hidden, args.experts, args.topk
    if distributed:
        bufs = cuda_ep.SymmBuffers.create(dist.group.WORLD, tc, H, K, dev)
    else:  # the peers' buffers are local memory: a single-GPU copy rate, no NVLink
        _, nbytes = cuda_ep.buffer_layout(P, tc, H, K)
        bufs = cuda_ep.SymmBuffers([torch.zeros(nbytes, dtype=torch.uint8, device=dev) for _ in range(P)], rank, tc,
                                   H, K, dev)
    g = torch.Generator(device=dev).manual_seed(1234)  # the same routing on every rank
    ids = torch.stack([torch.topk(torch.randn(tc, E, device=dev, generator=g), K, dim=1).indices for _ in range(P)])
    gl = torch.Generator(device=dev).manual_seed(99 + rank)
    bufs.local("tokens").copy_(torch.randn(bufs.local("tokens").shape, device=dev, generator=gl))
    e_l = E // P
    cap = cuda_ep.schedule_capacity(tc, K, e_l, P, MoKConfig().schedule_capacity_multiplier)
    eps = cuda_ep.make_ep_schedule(ids, tc, rank, e_l, cap)
    assert not bool(eps.overflow), "capacity overflow: raise the multiplier"
    out_rows = torch.randn(cap, H, device=dev, generator=gl).to(torch.bfloat16)
    # the own rows the next rank pulls (its pull_src row of this rank): for the pull-as-push case
    peer_wants = cuda_ep.make_ep_schedule(ids, tc, (rank + 1) % P, e_l, cap).pull_src[rank]
    return bufs, eps, out_rows, P, rank, peer_wants


def _cases(bufs, eps, out_rows, P, rank, peer_wants, cpsm_list):
    """{case: (bytes moved, {impl: fn})}"""
    lib, st = cb._lib(), cb._stream
    tc, H = bufs.tokens_cap, bufs.hidden
    peer = (rank + 1) % P
    tokens = bufs.local("tokens")
    dst_tok = torch.arange(P * tc, device=tokens.device).view(P, tc)
    sms = torch.cuda.get_device_properties(tokens.device).multi_processor_count
    row_bytes = H * 2
    pull_rows = int((eps.pull_src >= 0).sum())

    def v1_pull():
        for p in range(P):
            if p != rank:
                lib.launch("mok_ep_copy_rows", bufs.peer(p, "tokens"), eps.pull_src[p], tokens, dst_tok[p], stream=st())

    def v1_push(ps):
        def fn():
            for p in ps:
                lib.launch("mok_ep_copy_rows", out_rows, eps.push_src[p], bufs.peer(p, "slots"), eps.row_slot,
                           stream=st())
        return fn

    cases = {
        "pull": (pull_rows * row_bytes, {"v1": v1_pull}),
        "push_peer": (int((eps.push_src[peer] >= 0).sum()) * row_bytes, {"v1": v1_push([peer])}),
        "push_self": (int((eps.push_src[rank] >= 0).sum()) * row_bytes, {"v1": v1_push([rank])}),
        "push_all": (int((eps.row_src >= 0).sum()) * row_bytes, {"v1": v1_push(range(P))}),
        # the dispatch done by the owner instead: own rows stored into the next rank's tokens section
        # (what a push dispatch would cost; it would need one more barrier before the GEMM)
        "pull_as_push": (int((peer_wants >= 0).sum()) * row_bytes, {
            "v1": lambda: lib.launch("mok_ep_copy_rows", tokens, peer_wants, bufs.peer(peer, "tokens"), peer_wants,
                                     stream=st())}),
    }
    for c in cpsm_list:
        grid_pull = cuda_ep.copy_grid(P * tc, sms, c)
        grid_push = cuda_ep.copy_grid(out_rows.shape[0], sms, c)
        grid_peer = cuda_ep.copy_grid(tc, sms, c)

        def v2_pull(grid=grid_pull):
            lib.launch("mok_ep_pull_peers", bufs.section_addrs("tokens"), eps.pull_src, tokens, grid, stream=st())

        def copy2_pull(grid=grid_peer):
            for p in range(P):
                if p != rank:
                    lib.launch("mok_ep_copy_rows_v2", bufs.peer(p, "tokens"), eps.pull_src[p], tokens, dst_tok[p],
                               grid, stream=st())

        def v2_push_all(grid=grid_push):
            lib.launch("mok_ep_push_peers", out_rows, bufs.section_addrs("slots"), eps.row_src, eps.row_slot, grid,
                       stream=st())

        def copy2_push(ps, grid=grid_push):
            def fn():
                for p in ps:
                    lib.launch("mok_ep_copy_rows_v2", out_rows, eps.push_src[p], bufs.peer(p, "slots"), eps.row_slot,
                               grid, stream=st())
            return fn

        cases["pull"][1][f"v2@{c}"] = v2_pull
        cases["pull"][1][f"copy2@{c}"] = copy2_pull
        cases["push_peer"][1][f"copy2@{c}"] = copy2_push([peer])
        cases["push_self"][1][f"copy2@{c}"] = copy2_push([rank])
        cases["push_all"][1][f"v2@{c}"] = v2_push_all
        cases["push_all"][1][f"copy2@{c}"] = copy2_push(range(P))
        cases["pull_as_push"][1][f"copy2@{c}"] = lambda grid=grid_peer: lib.launch(
            "mok_ep_copy_rows_v2", tokens, peer_wants, bufs.peer(peer, "tokens"), peer_wants, grid, stream=st())
    return cases


def _sync_start(bufs, distributed):
    torch.cuda.synchronize()
    if distributed:
        bufs.barrier()  # both ranks leave this kernel together: their copies overlap as in the layer


def _check(bufs, eps, out_rows, P, rank, cases, distributed, first_v2):
    """v2 == v1 bitwise for pull (rows of the local tokens section) and push_all (every rank's slots)."""
    ok = {}
    for case, section in (("pull", "tokens"), ("push_all", "slots")):
        got = []
        for impl in ("v1", first_v2):
            dst = bufs.local(section)
            if section == "tokens":  # poison the peers' rows only (the own rows are the source of nothing here)
                mine = slice(rank * bufs.tokens_cap, (rank + 1) * bufs.tokens_cap)
                keep = dst[mine].clone()
                dst.fill_(float("nan"))
                dst[mine].copy_(keep)
            else:
                dst.fill_(float("nan"))
            _sync_start(bufs, distributed)
            cases[case][1][impl]()
            _sync_start(bufs, distributed)  # the peer's pushes into this rank's slots are done
            got.append(dst.clone())
        ok[case] = bool(torch.equal(got[0].view(torch.int16), got[1].view(torch.int16)))
    return ok


def _time(fn, bufs, distributed, warmup, iters):
    for _ in range(warmup):
        _sync_start(bufs, distributed)
        fn()
    times = []
    for _ in range(iters):
        _sync_start(bufs, distributed)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000.0)
    t = torch.tensor(times, device="cuda")
    if distributed:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return statistics.median(t.tolist())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--cpsm", default="1,2,4,8", help="CTAs per SM of the v2 kernels")
    args = ap.parse_args()
    distributed = "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1
    if distributed:
        dist.init_process_group("nccl")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", dist.get_rank())))
    cpsm = [int(c) for c in args.cpsm.split(",")]
    bufs, eps, out_rows, P, rank, peer_wants = _setup(args, distributed)
    cases = _cases(bufs, eps, out_rows, P, rank, peer_wants, cpsm)
    check = _check(bufs, eps, out_rows, P, rank, cases, distributed, f"v2@{cpsm[0]}")
    checks = [check]
    if distributed:
        checks = [None] * P
        dist.all_gather_object(checks, check)

    where = f"{P} GPUs, NVLink peers" if distributed else "1 GPU, peer = local memory"
    lines = [f"bench_ep_copy: {where}; tokens/rank {args.tokens}, H {args.hidden}, E {args.experts}, k {args.topk}, "
             f"cap {out_rows.shape[0]} rows; {torch.cuda.get_device_name()}",
             "v2 == v1 bitwise (pull, push_all), per rank: " + str(checks),
             f"{'case':12s} {'impl':9s} {'MiB':>8s} {'us':>9s} {'GB/s':>8s} {'vs v1':>6s}"]
    records = []
    for case, (nbytes, impls) in cases.items():
        base = None
        for impl, fn in impls.items():
            us = _time(fn, bufs, distributed, args.warmup, args.iters)
            base = base or us
            gbs = nbytes / us / 1e3
            lines.append(f"{case:12s} {impl:9s} {nbytes / 2**20:8.1f} {us:9.1f} {gbs:8.1f} {base / us:5.2f}x")
            records.append({"case": case, "impl": impl, "bytes": nbytes, "us": us, "gbps": gbs, "ranks": P,
                            "distributed": distributed, "tokens": args.tokens, "hidden": args.hidden})
    if rank == 0:
        print("\n".join(lines), flush=True)
        out = os.environ.get("OUT", "/tmp")
        os.makedirs(out, exist_ok=True)
        tag = "_x2" if distributed else "_x1"
        with open(os.path.join(out, f"bench_ep_copy{tag}.json"), "w") as f:
            json.dump({"checks": checks, "records": records}, f, indent=1)
        with open(os.path.join(out, f"bench_ep_copy{tag}.txt"), "w") as f:
            f.write("\n".join(lines) + "\n")
    if distributed:
        bufs.barrier()
        torch.cuda.synchronize()
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
