"""Diagnostic (one GPU, not a test): does the first launch of a kernel deadlock an overlapped pair?

    python tests/gpu/diag_ov_coldstart.py          (about 1 min; table on stdout, diag_ov_coldstart.{json,txt} in $OUT)

The overlapped EP forward runs pairs of kernels on two streams where one spins on flags the other
sets (docs/ep.md, "Overlapped forward: why it times out"). Claim under test: a kernel's FIRST
launch in a process blocks the host until the running kernels have finished (its module is loaded
then: the launcher's call_once Module_Load / CUDA lazy loading), so a pair whose spinning kernel is
launched first deadlocks on a cold process until the spin times out. Each case runs in a fresh
process (nothing loaded yet), with a 1 s readiness timeout:

  case                 pair, launch order                           predicted
  push_first_cold      push (waits), then the _done GEMM (old cuda_ep order)   err=1, GEMM launch blocks >= 1 s
  push_first_warm      the same after one stand-alone _done GEMM launch         err=0, bits equal
  gemm_first_cold      _done GEMM, then push (cuda_ep's order now)              err=0, bits equal
  dispatch_first_cold  dispatch, then the _ready GEMM (cuda_ep's order)         err=0, bits equal
  ready_first_cold     the _ready GEMM (waits), then dispatch (mirror image)    err=1 (supporting)
  push_first_eager     push_first_cold with CUDA_MODULE_LOADING=EAGER           informational
  gemm_dyn_first_cold  _done_dyn GEMM on every SM, then push (MOK_EP_OV_TILES=dynamic) err=0, bits equal
  dispatch_first_dyn_cold  dispatch, then the _ready_dyn GEMM on every SM        err=0, bits equal

The verdict line (exit status 0) depends on the "core" cases only (the first four and the two dyn ones).

"bits equal": the pair's output rows are bitwise those of the sequential construction (plain GEMM,
copies), computed after the pair. With the fail-fast waits (readiness.wait_flag) a deadlocked pair
costs about one timeout; without them, one per tile of each comm CTA (several seconds here).
"""

import json
import os
import subprocess
import sys
import time

CASES = {  # name: (pair, spinning kernel first?, warm-up launch?, extra env, predicted err, role)
    # role: "core" decides the verdict; "support" (same mechanism, another kernel) and "info" are reported
    "push_first_cold": ("push", True, False, {}, 1, "core"),
    "push_first_warm": ("push", True, True, {}, 0, "core"),
    "gemm_first_cold": ("push", False, False, {}, 0, "core"),
    "dispatch_first_cold": ("dispatch", False, False, {}, 0, "core"),
    "ready_first_cold": ("dispatch", True, False, {}, 1, "support"),
    "push_first_eager": ("push", True, False, {"CUDA_MODULE_LOADING": "EAGER"}, None, "info"),
    # dynamic tiles (pair "*_dyn"): the _dyn GEMMs on every SM, cuda_ep's launch order
    "gemm_dyn_first_cold": ("push_dyn", False, False, {}, 0, "core"),
    "dispatch_first_dyn_cold": ("dispatch_dyn", False, False, {}, 0, "core"),
}
TIMEOUT_US = 1_000_000
COMM_CTAS = 4


def _problem(torch, cuda_ep, width, n_out, tokens, E, K, seed):
    """Rank 1 of 2 simulated ranks: sections, schedule, the sequential A rows, weights [E_l, n_out, width]."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    P, tc = len(tokens), max(tokens)
    ids = torch.full((P, tc, K), -1, dtype=torch.int64, device="cuda")
    secs = []
    for s in range(P):
        ids[s, :tokens[s]] = torch.topk(torch.randn(tokens[s], E, device="cuda", generator=g), K, dim=1).indices
        sec = torch.zeros(P * tc + 1, width, dtype=torch.bfloat16, device="cuda")
        sec[s * tc:s * tc + tokens[s]] = torch.randn(tokens[s], width, device="cuda", generator=g).to(torch.bfloat16)
        secs.append(sec)
    e_l, rank = E // P, 1
    cap = cuda_ep.schedule_capacity(tc, K, e_l, P, 2.0)
    eps = cuda_ep.make_ep_schedule(ids, tokens[rank], rank, e_l, cap)
    merged = secs[rank].clone()
    for s in range(P):
        if s != rank:
            need = eps.pull_src[s][eps.pull_src[s] >= 0]
            merged[need] = secs[s][need]
    a_rows = merged.index_select(0, eps.sched.row_token)
    w = (torch.randn(e_l, n_out, width, device="cuda", generator=g) / width**0.5).to(torch.bfloat16)
    return secs, eps, a_rows, w, tc, rank


def child(name):
    import torch

    import mok_nn.cuda_backend as cb
    from mok_nn import cuda_ep
    from mok_nn.kernels import loader

    pair, spinner_first, warm, _, _, _ = CASES[name]
    dyn = pair.endswith("_dyn")
    pair = pair.removesuffix("_dyn")
    lib = loader.load("sm_90a")
    torch.cuda.set_device(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    comm_ctas, gemm_ctas = cuda_ep.split_sms(sms, COMM_CTAS)
    # dyn: the GEMM on every SM; extra trailing argument tile_counter ([0] done, [0, comm] ready)
    suffix, grid = ("_dyn", sms) if dyn else ("", gemm_ctas)
    ctr = torch.tensor([0, comm_ctas] if pair == "dispatch" else [0], dtype=torch.int32, device="cuda")
    extra = (ctr,) if dyn else ()
    side, main = torch.cuda.Stream(priority=-1), torch.cuda.current_stream()
    err = torch.zeros(1, dtype=torch.int32, device="cuda")
    tokens, E, K = [1500, 1400], 32, 4
    if pair == "push":
        width, n_out = 256, 1024  # h rows (I) -> y rows (H)
        secs, eps, a_rows, w, tc, rank = _problem(torch, cuda_ep, width, n_out, tokens, E, K, seed=1)
    else:
        width, n_out = 1024, 512  # x rows (H) -> gate_up rows
        secs, eps, a_rows, w, tc, rank = _problem(torch, cuda_ep, width, n_out, tokens, E, K, seed=2)
    sched = eps.sched
    gemm = cb.gemm_kernel(False, torch.bfloat16, k=width, pingpong=False)
    n_tiles = sched.tile_expert.numel()
    tiles_n = -(-n_out // cb.GEMM_TILE_N)
    wt = w.permute(1, 2, 0)
    torch.cuda.synchronize()

    if pair == "push":
        slots = [torch.full((tc * K, n_out), float("nan"), dtype=torch.bfloat16, device="cuda") for _ in range(2)]
        base = torch.tensor([s.data_ptr() for s in slots], dtype=torch.int64, device="cuda")
        out = torch.full((sched.capacity, n_out), float("nan"), dtype=torch.bfloat16, device="cuda")
        done = torch.zeros(n_tiles, dtype=torch.int32, device="cuda")
        row_rank = eps.row_src.to(torch.int32)
        if warm:
            scratch, cnt = torch.empty_like(out), torch.zeros_like(done)
            lib.launch(gemm + "_done", a_rows.unsqueeze(-1), wt, scratch.unsqueeze(-1), sched.tile_expert,
                       sched.seg_end, sched.gemm_seg_rows(), 1, cnt, gemm_ctas, stream=main.cuda_stream)
            torch.cuda.synchronize()

        def spinner():
            lib.launch("mok_ep_push_rows", out, base, row_rank, eps.row_slot, sched.tile_expert, done, err,
                       tiles_n, TIMEOUT_US, comm_ctas, stream=side.cuda_stream)

        def setter():
            lib.launch(gemm + "_done" + suffix, a_rows.unsqueeze(-1), wt, out.unsqueeze(-1), sched.tile_expert,
                       sched.seg_end, sched.gemm_seg_rows(), 1, done, grid, *extra, stream=main.cuda_stream)
    else:
        row_peer, row_src = cuda_ep.dispatch_plan(eps, rank)
        base = torch.tensor([s.data_ptr() for s in secs], dtype=torch.int64, device="cuda")
        x_rows = torch.full((sched.capacity, width), float("nan"), dtype=torch.bfloat16, device="cuda")
        out = torch.full((sched.capacity, n_out), float("nan"), dtype=torch.bfloat16, device="cuda")
        ready = torch.zeros(n_tiles, dtype=torch.int32, device="cuda")

        def setter():
            lib.launch("mok_ep_dispatch_rows", x_rows, base, row_peer, row_src, sched.tile_expert, ready, err, 1,
                       TIMEOUT_US, comm_ctas, stream=side.cuda_stream)

        def spinner():
            lib.launch(gemm + "_ready" + suffix, x_rows.unsqueeze(-1), wt, out.unsqueeze(-1), sched.tile_expert,
                       sched.seg_end, sched.gemm_seg_rows(), 1, ready, err, 1, TIMEOUT_US, grid, *extra,
                       stream=main.cuda_stream)

    side.wait_stream(main)
    launch_s = []
    t0 = time.perf_counter()
    for fn in ((spinner, setter) if spinner_first else (setter, spinner)):
        t = time.perf_counter()
        fn()
        launch_s.append(time.perf_counter() - t)
    main.wait_stream(side)
    torch.cuda.synchronize()
    total_s = time.perf_counter() - t0

    # the sequential construction, after the pair (plain GEMM: another module)
    ref = torch.full((sched.capacity, n_out), float("nan"), dtype=torch.bfloat16, device="cuda")
    cb.launch_gemm(gemm, a_rows, wt, ref, sched)
    used = torch.repeat_interleave(sched.tile_expert >= 0, 128)
    if pair == "push":
        bits = True
        for p in range(2):
            want = torch.full_like(slots[p], float("nan"))
            ok = eps.push_src[p] >= 0
            want[eps.row_slot[ok]] = ref[eps.push_src[p][ok]]
            bits &= torch.equal(slots[p].view(torch.int16), want.view(torch.int16))
    else:
        bits = torch.equal(x_rows[used].view(torch.int16), a_rows[used].view(torch.int16)) and torch.equal(
            out[used].view(torch.int16), ref[used].view(torch.int16))
    order = ["spinner", "setter"] if spinner_first else ["setter", "spinner"]
    return dict(case=name, err=int(err.item()), bits_equal=bool(bits), total_s=round(total_s, 3),
                launch_ms={o: round(s * 1e3, 2) for o, s in zip(order, launch_s)},
                used_tiles=int((sched.tile_expert >= 0).sum()), comm_ctas=comm_ctas)


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--case":
        print("RESULT " + json.dumps(child(sys.argv[2])), flush=True)
        return 0
    lines, records, confirmed = [], [], True

    def log(s):
        print(s, flush=True)
        lines.append(s)

    log(f"{'case':<20} {'err':>3} {'bits':>5} {'total s':>8} {'launch ms (in launch order)':<40} predicted")
    for name, (_, _, _, env, want_err, role) in CASES.items():
        t0 = time.time()
        limit = 180 if env else 90  # EAGER loads all of torch's kernels at start-up
        try:
            proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--case", name], capture_output=True,
                                  text=True, timeout=limit, env={**os.environ, **env})
            found = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            rec = json.loads(found[-1][7:]) if found else dict(case=name, failed=(proc.stderr or "")[-600:])
        except subprocess.TimeoutExpired:
            rec = dict(case=name, failed=f"no result within {limit} s ({time.time() - t0:.0f} s)")
        rec["role"] = role
        records.append(rec)
        if "failed" in rec:
            log(f"{name:<20} FAILED TO RUN: {rec['failed']}")
            confirmed &= role != "core"
            continue
        pred = "-" if want_err is None else f"err={want_err}" + (", bits equal" if want_err == 0 else "")
        match = want_err is None or (rec["err"] == want_err and (want_err == 1 or rec["bits_equal"]))
        confirmed &= match or role != "core"
        launches = " ".join(f"{k} {v:.1f}" for k, v in rec["launch_ms"].items())
        log(f"{name:<20} {rec['err']:>3} {str(rec['bits_equal']):>5} {rec['total_s']:8.2f} {launches:<40} "
            f"{pred} {'ok' if match else 'MISMATCH'} ({role})")
    log("diagnosis " + ("CONFIRMED: a cold first launch of the flag-setting kernel behind a spinning kernel deadlocks "
                        "until the timeout; the setter-first order does not" if confirmed else
                        "NOT confirmed (see the MISMATCH / FAILED lines of the core cases)"))
    out = os.environ.get("OUT", "/tmp")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "diag_ov_coldstart.json"), "w") as f:
        json.dump(records, f, indent=1)
    with open(os.path.join(out, "diag_ov_coldstart.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return 0 if confirmed else 1


if __name__ == "__main__":
    sys.exit(main())
