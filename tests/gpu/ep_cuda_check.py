"""Expert parallelism on CUDA (symmetric memory + CuTe DSL kernels) on 2+ GPUs of one host.

Run with:  torchrun --nproc_per_node 2 tests/gpu/ep_cuda_check.py   (about 1 min; log to $OUT/ep_cuda_check.log)
On a machine with one GPU:  MOK_EP_CHECK_ONE_GPU=1 torchrun --nproc_per_node 2 tests/gpu/ep_cuda_check.py
  runs the ranks on that GPU over a gloo group (NCCL takes one rank per GPU) and only the checks such a group can
  take: the cross-host mode (the portable exchange, here over gloo with CUDA tensors, and its local experts on the
  kernels) against the reference path over the same group, bf16 and MXFP8.
Checks, each printed as one PASS/FAIL line by rank 0, exit status non-zero if any fails:
  - layer(backend="cuda", EP=P) against layer(backend="reference", EP=P over NCCL): y and every
    gradient within bf16 rounding (rel L2 < 2e-2), outputs poisoned first (NaN never passes)
  - bitwise identical across runs
  - whole layer EP=P vs the single-GPU CUDA path on the concatenated batch: close (bitwise equality
    and whether the router logits agree are reported; the router GEMM runs over other row counts)
  - fixed routing (the same top-k ids and weights fed to both): routed experts at EP=P (cuda_ep)
    bitwise equal to EP=1 (cuda_backend, one rank computing all experts over all ranks' tokens),
    for swiglu, swiglu with limit, GPT-OSS (swiglu_oai, limit, biases); max abs diff per tensor
  - the same under torch.use_deterministic_algorithms(True): nothing raises, bits unchanged
  - row copies: the kernels (default) and MOK_EP_COPY=torch give the same bits (fixed routing), each run twice
  - step 1 of the forward: mok_ep_publish and the torch ops (MOK_EP_COPY=torch) give the same bits (fixed
    routing, fp32 and bf16 top-k weights, published sections poisoned first), each run twice
  - the paths the rules pick elsewhere (token / d y rows pulled, pulled whole, pushed or scattered; the
    combine and d x pushed by the GEMMs, as slot rows or as per-rank sums), set by patching cuda_ep's rules:
    the same bits, each run twice
  - capacity overflow -> NaN outputs and EPError, and the next step works again
  - token capacity growth: a batch above the capacity (same count on all ranks, then different
    counts) -> NaN + EPError on every rank, the next call grows the buffer on every rank, results
    close to the reference path and, for an earlier batch, bitwise unchanged; reserve_tokens
  - a peer that never signals -> the barrier returns within its timeout with the error flag set
  - the group made to look like two hosts: auto takes the portable exchange over NCCL (bounded and host-split)
    with its local experts on the kernels, close to the EP kernels (bf16) / the reference path (MXFP8), repeatable
  - workspace shapes that differ across ranks -> ValueError on every rank
INFO lines are diagnostics (not pass/fail).
Filter (to repeat one case quickly): MOK_EP_CHECK_ONLY="fixed oai,two layers" runs only the checks of those
names (see main()).
"""

import os
import sys
import time
import traceback

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic mode and cuBLAS (router GEMM)
os.environ.setdefault("MOK_EP_TIMEOUT_S", "20")  # a barrier bug costs 20 s, not 300 (read at import)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import layer_runs  # noqa: E402
from layer_runs import GRAD_NAMES  # noqa: E402
from mok_nn import MoKConfig, MoKMoELayer, cuda_ep, functional  # noqa: E402
from mok_nn.autograd import MoKFunction  # noqa: E402

RESULTS = []
LOG = []


def log(line, all_ranks=False):
    """Print on rank 0 (or every rank, prefixed) and keep for the log file."""
    if all_ranks:
        line = f"[rank {dist.get_rank()}] {line}"
    if all_ranks or dist.get_rank() == 0:
        print(line, flush=True)
        LOG.append(line)


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _ep_error(ws):
    """The text of the EPError the workspace's pending step raises ("" if none); waits for the step."""
    try:
        cuda_ep.check_errors(ws)
    except cuda_ep.EPError as err:
        return str(err)
    return ""


def report(name, ok, detail=""):
    flag = torch.tensor([1 if ok else 0], device="cuda", dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    ok = bool(flag.item())
    RESULTS.append(ok)
    log(f"{'PASS' if ok else 'FAIL'}  {name}  {detail}")


def check(name, fn):
    only = os.environ.get("MOK_EP_CHECK_ONLY", "")
    if only and name not in only.split(","):
        return
    try:
        fn()
    except Exception:  # one failing check must not hide the others
        detail = traceback.format_exc().strip().splitlines()
        log(f"{name} raised:\n" + "\n".join(detail[-12:]), all_ranks=True)
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
    # informational: reported, not a pass/fail criterion beyond closeness (the routing differs when
    # the router GEMM rounds differently over this rank's rows than over the whole batch)
    report(f"{name}: whole layer EP={world} vs EP=1 (cuda) close", all(e < 2e-2 for e in errs1.values()))
    logits_same = torch.equal(layers["cuda"].router_logits, full.router_logits[lo:lo + T])
    log(f"INFO  {name}: whole layer EP={world} vs EP=1: router logits bitwise equal {logits_same}; outputs "
        "bitwise equal: " + " ".join(f"{k}={v}" for k, v in same.items()), all_ranks=True)
    ws = layers["cuda"]
    wsp = functional.get_workspace(hidden_size=H, intermediate_size=I, num_experts=E, top_k=K,
                                   ep_group=dist.group.WORLD, device=x.device, dtype=x.dtype, backend="cuda",
                                   activation=ws.activation, swiglu_limit=ws.swiglu_limit, config=ws.config)
    log(f"      workspace {wsp.nbytes / 2**20:.1f} MiB (symmetric buffer, token capacity "
        f"{wsp.ep_state['bufs'].tokens_cap})")


# --------------------------------------------------------------------------
# fixed routing: EP=P (cuda_ep) against EP=1 (cuda_backend) on the same ids and weights


def _rank_inputs(r, T, H, E, K):
    """Rank r's tokens, d y, top-k ids and weights: the same on every rank that builds them."""
    g = torch.Generator(device="cuda").manual_seed(1000 + r)
    x = torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16)
    dy = torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16)
    logits = torch.randn(T, E, device="cuda", generator=g)
    logits[:, : E // 4] += 1.5  # uneven load
    top = torch.topk(logits, K, dim=1)
    return x, dy, top.indices, torch.softmax(top.values, dim=1)


def _experts(ws, x, w, ids, dy, params):
    """{name: tensor}: y and the gradients of the routed experts (MoKFunction) on ws."""
    x = x.clone().requires_grad_()
    w = w.clone().requires_grad_()
    ps = [None if p is None else p.detach().clone().requires_grad_() for p in params]
    y = MoKFunction.apply(x, w, *ps, ids, ws)
    y.backward(dy)
    out = {"y": y.detach(), "dx": x.grad, "dw": w.grad, "dW13": ps[0].grad, "dW2": ps[1].grad}
    if ps[2] is not None:
        out.update(db13=ps[2].grad, db2=ps[3].grad)
    return out


def _diff(got, want):
    """'name=eq|maxabs' for each tensor, and whether all are bitwise equal."""
    parts, all_eq = [], True
    for k in want:
        eq = torch.equal(got[k], want[k])
        all_eq &= eq
        d = (got[k].double() - want[k].double()).abs().max().item() if got[k].numel() else 0.0
        parts.append(f"{k}={'eq' if eq else f'{d:.1e}'}")
    return " ".join(parts), all_eq


def _expert_params(seed, H, I, E, bias=False):
    """([W13, W2, b13, b2] of all E experts, the same on every rank; this rank's slice of each).
    Biases are None without bias (and then not drawn: the same weights as with bias)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    per = E // world
    g = torch.Generator(device="cuda").manual_seed(seed)
    W13 = (torch.randn(E, 2 * I, H, device="cuda", generator=g) / H**0.5).to(torch.bfloat16)
    W2 = (torch.randn(E, H, I, device="cuda", generator=g) / I**0.5).to(torch.bfloat16)
    b13 = (torch.randn(E, 2 * I, device="cuda", generator=g) * 0.5).to(torch.bfloat16) if bias else None
    b2 = (torch.randn(E, H, device="cuda", generator=g) * 0.5).to(torch.bfloat16) if bias else None
    full = [W13, W2, b13, b2]
    return full, [None if p is None else p[rank * per:(rank + 1) * per] for p in full]


def case_fixed_routing(name, H, I, E, K, T_by_rank, activation="swiglu", limit=None, bias=False):
    rank, world = dist.get_rank(), dist.get_world_size()
    per = E // world
    full, local = _expert_params(7, H, I, E, bias)  # same weights on every rank
    ins = [_rank_inputs(r, T_by_rank[r], H, E, K) for r in range(world)]
    x, dy, ids, w = ins[rank]
    xa, dya, idsa, wa = (torch.cat([i[n] for i in ins]) for n in range(4))
    common = dict(hidden_size=H, intermediate_size=I, num_experts=E, top_k=K, device=x.device, dtype=x.dtype,
                  backend="cuda", activation=activation, swiglu_limit=limit)
    ws_ep = functional.get_workspace(ep_group=dist.group.WORLD, **common)
    ws_1 = functional.get_workspace(ep_group=None, **common)

    def both():
        got = _experts(ws_ep, x, w, ids, dy, local)
        cuda_ep.check_errors(ws_ep)
        one = _experts(ws_1, xa, wa, idsa, dya, full)
        lo = sum(T_by_rank[:rank])
        want = {k: (v[lo:lo + len(x)] if k in ("y", "dx", "dw") else v[rank * per:(rank + 1) * per])
                for k, v in one.items()}
        return got, want

    got, want = both()
    detail, all_eq = _diff(got, want)
    close = all(rel(got[k], want[k]) < 2e-2 for k in want) and not any(torch.isnan(v).any() for v in got.values())
    report(f"{name}: fixed routing, EP={world} close to EP=1", close)
    report(f"{name}: fixed routing, EP={world} bitwise equal to EP=1", all_eq)
    log(f"      {name}: {detail}", all_ranks=True)

    torch.use_deterministic_algorithms(True)
    try:
        got_d, want_d = both()
    finally:
        torch.use_deterministic_algorithms(False)
    same = all(torch.equal(got_d[k], got[k]) and torch.equal(want_d[k], want[k]) for k in got)
    report(f"{name}: under torch.use_deterministic_algorithms(True): no error, same bits (EP={world} and EP=1)",
           same)


def _fixed_case(params_seed, inputs_offset, H, I, E, K, T_by_rank):
    """The set-up of a mode case: (workspace, this rank's expert params, x, dy, ids, w), the expert params from
    params_seed, this rank's inputs from rank + inputs_offset."""
    rank = dist.get_rank()
    _, local = _expert_params(params_seed, H, I, E)
    x, dy, ids, w = _rank_inputs(rank + inputs_offset, T_by_rank[rank], H, E, K)
    ws = functional.get_workspace(hidden_size=H, intermediate_size=I, num_experts=E, top_k=K, device=x.device,
                                  dtype=x.dtype, backend="cuda", ep_group=dist.group.WORLD)
    return ws, local, x, dy, ids, w


def case_copy_modes(name, H, I, E, K, T_by_rank):
    """Fixed routing: the kernel row copies (default) and MOK_EP_COPY=torch give the same bits (y and all
    gradients), each run twice."""
    ws, local, x, dy, ids, w = _fixed_case(13, 0, H, I, E, K, T_by_rank)
    runs = _runs_by_env(ws, x, w, ids, dy, local, {mode: {"MOK_EP_COPY": mode} for mode in ("kernel", "torch")})
    _report_mode_runs(name, "MOK_EP_COPY", runs, "torch")


def _no(*args, **kwargs):
    return False


def case_down_push_modes(name, H, I, E, K, T_by_rank):
    """Fixed routing: the down GEMM and the dgrad of gate/up sending their rows to the sources' slots
    themselves (down_push, dx_push_mode 'gemm': the default where H <= 2048), each alone, and neither (the GEMM
    then the combine push of combine_sums' form, and per-rank d x sums by the copy engines; also with slot
    rows): the same bits (y and all gradients), each run twice, the slots and d x slots poisoned before each
    run (every row a token reads must be written in the run)."""
    ws, local, x, dy, ids, w = _fixed_case(19, 50, H, I, E, K, T_by_rank)
    settings = {"GEMMs push": {},
                "no push GEMMs": {"_gemm_push_ok": _no},
                "no push GEMMs, slot sums": {"_gemm_push_ok": _no, "combine_sums": lambda *a, **k: "slot"},
                "down GEMM pushes": {"_gemm_push_ok": lambda a: a.shape[1] == I},  # (h: I wide; d gate_up: 2I)
                "dgrad GEMM pushes": {"_gemm_push_ok": lambda a: a.shape[1] == 2 * I}}
    runs = _runs_by_env(ws, x, w, ids, dy, local, settings, poison=("slots", "dxslots"))
    _report_mode_runs(name, None, runs, "no push GEMMs")


def _rows(mode, push=False):
    """Patches that make the token (and d y) rows move as `mode` says; push: scatter where the kernel cannot
    run (what the forward and the backward push instead)."""
    patch = {"token_rows_mode": lambda num_experts, ep_size, top_k: mode}
    return {**patch, "scatter_from_ranks_ok": _no} if push else patch


def case_token_rows_modes(name, H, I, E, K, T_by_rank):
    """Fixed routing: the forward's token rows pulled where needed, pulled whole after the barrier, pushed by
    the publish launch, or read from each peer's own section by the gather (token_rows_mode, patched), with the
    backward's d y rows pulled, pushed or read the same way: the same bits (y and all gradients), each run
    twice, every tokens and dy section poisoned before each run."""
    ws, local, x, dy, ids, w = _fixed_case(23, 60, H, I, E, K, T_by_rank)
    settings = {"needed / pull": _rows("needed"), "all / pull": _rows("all"), "push / push": _rows("scatter", True),
                "scatter / scatter": _rows("scatter")}
    runs = _runs_by_env(ws, x, w, ids, dy, local, settings, poison=("tokens", "dy"))
    _report_mode_runs(name, None, runs, "needed / pull")


def _runs_by_env(ws, x, w, ids, dy, local, envs, poison=()):
    """{label: [two runs of _experts]} with each label's settings set for its runs (then put back): MOK_*
    keys environment variables, the others cuda_ep functions replaced by the given ones; the sections named in
    `poison` of this rank's buffer filled with NaN before each run (every row a run reads there must be
    written in it), check_errors after each label."""
    runs = {}
    for label, setting in envs.items():
        env = {k: v for k, v in setting.items() if k.startswith("MOK_")}
        patches = {k: v for k, v in setting.items() if not k.startswith("MOK_")}
        saved = {var: os.environ.get(var) for var in env}
        real = {name: getattr(cuda_ep, name) for name in patches}
        os.environ.update(env)
        for attr, fn in patches.items():
            setattr(cuda_ep, attr, fn)
        try:
            runs[label] = []
            for _ in range(2):
                if poison:
                    bufs = ws.ep_state.get("bufs")  # (none before the workspace's first call)
                    for section in poison if bufs is not None else ():
                        bufs.local(section).fill_(float("nan"))
                    torch.cuda.synchronize()
                    dist.barrier()
                runs[label].append(_experts(ws, x, w, ids, dy, local))
        finally:
            for var, value in saved.items():
                if value is None:
                    os.environ.pop(var, None)
                else:
                    os.environ[var] = value
            for attr, fn in real.items():
                setattr(cuda_ep, attr, fn)
        cuda_ep.check_errors(ws)
    return runs


def case_two_layers(name, H, I, E, K, T_by_rank):
    """Two layers with the same shapes share one workspace: forward A, forward B, backward B, backward
    A (as in training) gives A the bits of forward A, backward A alone (y and every gradient): with the rules'
    paths (here the rows read from the peers' own sections, the GEMMs pushing their rows), and without the push
    GEMMs for the per-rank d x sums (they read the forward's copy of the routing, not the ids section B's
    forward overwrote) and for slot rows."""
    rank = dist.get_rank()
    _, pa = _expert_params(21, H, I, E)
    _, pb = _expert_params(22, H, I, E)
    xa, dya, ida, wa = _rank_inputs(rank + 70, T_by_rank[rank], H, E, K)
    xb, dyb, idb, wb = _rank_inputs(rank + 80, T_by_rank[rank], H, E, K)
    ws = functional.get_workspace(hidden_size=H, intermediate_size=I, num_experts=E, top_k=K, device=xa.device,
                                  dtype=xa.dtype, backend="cuda", ep_group=dist.group.WORLD)
    for what, patches in (("the rules' paths", {}),
                          ("rank sums", {"_gemm_push_ok": _no, "combine_sums": lambda *a, **k: "rank"}),
                          ("slot sums", {"_gemm_push_ok": _no, "combine_sums": lambda *a, **k: "slot"})):
        real = {attr: getattr(cuda_ep, attr) for attr in patches}
        for attr, fn in patches.items():
            setattr(cuda_ep, attr, fn)
        try:
            alone = _experts(ws, xa, wa, ida, dya, pa)
            xa_, wa_ = xa.clone().requires_grad_(), wa.clone().requires_grad_()
            psa = [None if p is None else p.detach().clone().requires_grad_() for p in pa]
            ya = MoKFunction.apply(xa_, wa_, *psa, ida, ws)
            _experts(ws, xb, wb, idb, dyb, pb)  # B's forward and backward in between
            ya.backward(dya)
            inter = {"y": ya.detach(), "dx": xa_.grad, "dw": wa_.grad, "dW13": psa[0].grad, "dW2": psa[1].grad}
        finally:
            for attr, fn in real.items():
                setattr(cuda_ep, attr, fn)
        cuda_ep.check_errors(ws)
        detail, eq = _diff(inter, alone)
        report(f"{name}: {what}: layer A's bits unchanged by layer B's step in between", eq, detail)


def case_macrobatch(name, H, I, E, K, T, size):
    """MoKConfig.macrobatch_size at EP=P: y, d x and d topk-weights are the one-pass bits, the expert
    gradients the per-pass gradients (separate one-pass calls) summed in pass order in bf16, the
    symmetric workspace is sized by the pass, and token counts that differ across the ranks raise
    ValueError on every rank."""
    rank = dist.get_rank()
    _, params = _expert_params(31, H, I, E)
    x, dy, ids, w = _rank_inputs(rank + 90, T, H, E, K)
    common = dict(hidden_size=H, intermediate_size=I, num_experts=E, top_k=K, device=x.device, dtype=x.dtype,
                  backend="cuda", ep_group=dist.group.WORLD)
    ws_one = functional.get_workspace(**common)
    ws_mb = functional.get_workspace(config=MoKConfig(minibatch_size=128, macrobatch_size=size), **common)
    one = _experts(ws_one, x, w, ids, dy, params)
    got = _experts(ws_mb, x, w, ids, dy, params)
    again = _experts(ws_mb, x, w, ids, dy, params)
    parts = [_experts(ws_one, x[s:s + size], w[s:s + size], ids[s:s + size], dy[s:s + size], params)
             for s in range(0, T, size)]
    cuda_ep.check_errors(ws_one)
    cuda_ep.check_errors(ws_mb)
    report(f"{name}: bitwise reproducible", _diff(again, got)[1])
    detail, eq = _diff({k: got[k] for k in ("y", "dx", "dw")}, {k: one[k] for k in ("y", "dx", "dw")})
    report(f"{name}: y, d x, d topk-weights are the one-pass bits", eq, detail)
    want = {k: parts[0][k] for k in ("dW13", "dW2")}
    for part in parts[1:]:
        want = {k: want[k] + part[k] for k in want}  # bf16 + bf16, one rounding per pass
    detail, eq = _diff({k: got[k] for k in want}, want)
    report(f"{name}: expert gradients are the per-pass sum ({len(parts)} passes)", eq, detail)
    log(f"INFO  {name}: workspace {ws_mb.nbytes / 2**20:.1f} MiB with {size}-token passes, "
        f"{ws_one.nbytes / 2**20:.1f} MiB for {T} tokens in one pass")
    report(f"{name}: the workspace holds one pass", ws_mb.ep_state["bufs"].tokens_cap == size,
           f"capacity {ws_mb.ep_state['bufs'].tokens_cap}")
    # a workspace first used with a batch smaller than a pass grows to a pass before the passes
    # (cuda_ep.reserve_pass), instead of flagging each of them
    ws_small = functional.get_workspace(config=MoKConfig(minibatch_size=64, macrobatch_size=size), **common)
    _experts(ws_small, x[:size // 4], w[:size // 4], ids[:size // 4], dy[:size // 4], params)
    grown = _experts(ws_small, x, w, ids, dy, params)
    cuda_ep.check_errors(ws_small)
    detail, eq = _diff(grown, got)
    report(f"{name}: a smaller first batch, then passes: the capacity grows to a pass, same bits", eq
           and ws_small.ep_state["bufs"].tokens_cap == size, detail)
    try:
        n = T - rank  # the last rank one token short
        _experts(ws_mb, x[:n], w[:n], ids[:n], dy[:n], params)
        report(f"{name}: token counts differing across ranks raise ValueError", False, "no error")
    except ValueError as err:
        report(f"{name}: token counts differing across ranks raise ValueError", "same number of tokens" in str(err),
               str(err)[:120])


def _report_mode_runs(label, var, runs, ref):
    """One PASS/FAIL line per mode of runs {mode: [first run, repeats...]} (mode named `var=mode`, or
    as is without var): the first run has ref's first run's bits (y and every gradient), every repeat
    the first run's, and nothing is NaN. A repeat that differs is named with the tensors that differ
    (on every rank: one rank may differ alone)."""
    for mode, (a, *rest) in runs.items():
        what = f"{var}={mode}" if var else mode
        nan = any(torch.isnan(v).any() for v in a.values())
        detail, eq = _diff(a, runs[ref][0])
        diffs = [(i + 1, *_diff(b, a)) for i, b in enumerate(rest)]
        bad = [(i, d) for i, d, same in diffs if not same]
        again = not bad
        if bad:
            log(f"      {label}: {what}: repeats unlike run 0: " + "; ".join(f"run {i}: {d}" for i, d in bad),
                all_ranks=True)
        on = "a repeat" if len(rest) == 1 else f"{len(rest)} repeats"
        report(f"{label}: {what}: bitwise equal to {ref}, and on {on}", eq and again and not nan,
               "" if eq and again else f"{detail} repeat={again} nan={nan}")


def _poison_published(ws):
    """Every rank fills what the EP forward's step 1 writes into its buffer (own tokens rows, ids,
    weights but the zero last element, ntok) with 0x7f bytes / NaN / expert 0 (an id that indexes
    nothing out of range), then waits for all ranks: a publish that misses a store leaves poison,
    not the previous step's values."""
    bufs = ws.ep_state["bufs"]
    r, tc = bufs.rank, bufs.tokens_cap
    bufs.local("tokens")[r * tc:(r + 1) * tc].view(torch.int16).fill_(0x7F7F)
    bufs.local("ids").fill_(0)
    bufs.local("weights")[:-1].fill_(float("nan"))
    bufs.local("ntok").fill_(0x7F7F7F7F)
    torch.cuda.synchronize()
    dist.barrier()


def case_publish_modes(name, H, I, E, K, T_by_rank):
    """Fixed routing: step 1 of the forward as one mok_ep_publish launch (the default) and as torch ops
    (MOK_EP_COPY=torch, with the other row copies) give the same bits (y and all gradients), fp32 and bf16
    top-k weights, the published sections poisoned before each run, each mode run twice."""
    ws, local, x, dy, ids, w = _fixed_case(17, 50, H, I, E, K, T_by_rank)  # not the inputs of other cases
    for wdt in (torch.float32, torch.bfloat16):
        wt = w.to(wdt)
        runs = {}
        for mode in ("torch", "kernel"):
            os.environ["MOK_EP_COPY"] = mode
            try:
                if ws.ep_state.get("bufs") is None:
                    _experts(ws, x, wt, ids, dy, local)  # creates the buffer
                runs[mode] = []
                for _ in range(2):
                    _poison_published(ws)
                    runs[mode].append(_experts(ws, x, wt, ids, dy, local))
            finally:
                del os.environ["MOK_EP_COPY"]
            cuda_ep.check_errors(ws)
        _report_mode_runs(f"{name} ({str(wdt)[6:]} weights)", "MOK_EP_COPY", runs, "torch")


# --------------------------------------------------------------------------
# token capacity growth


def case_growth():
    rank, world = dist.get_rank(), dist.get_world_size()
    H, I, E, K = 320, 128, 16, 2  # a shape of its own: a fresh workspace
    torch.manual_seed(3)
    full = MoKMoELayer(H, I, E, K, device="cuda", backend="cuda")
    sd = full.state_dict()
    per = E // world
    lays = {}
    for backend in ("cuda", "reference"):
        lays[backend] = MoKMoELayer(H, I, E, K, device="cuda", backend=backend, ep_group=dist.group.WORLD)
        lays[backend].load_state_dict(shard(sd, rank, per))
    lay = lays["cuda"]
    ws = functional.get_workspace(hidden_size=H, intermediate_size=I, num_experts=E, top_k=K,
                                  ep_group=dist.group.WORLD, device=torch.device("cuda"), dtype=torch.bfloat16,
                                  backend="cuda", activation=lay.activation, swiglu_limit=lay.swiglu_limit,
                                  config=lay.config)

    def data(T, seed):
        g = torch.Generator(device="cuda").manual_seed(seed + rank)
        return (torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16),
                torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16))

    x0, dy0 = data([64, 48][rank], 10)
    first = run_layer(lay, x0, dy0)
    cuda_ep.check_errors(ws)
    cap0 = ws.ep_state["bufs"].tokens_cap
    report("growth: first batch sets the capacity (largest of the ranks)", cap0 == 64, f"capacity {cap0}")

    for label, sizes in (("same count on all ranks", [100, 100]), ("different counts", [150, 90])):
        x, dy = data(sizes[rank], 20 + sizes[0])
        t0 = time.time()
        with torch.no_grad():  # forward only: the error is raised below at the same point on every rank
            y_bad = lay(x)
        raised = _ep_error(ws)
        elapsed = time.time() - t0
        report(f"growth ({label}): batch above the capacity -> NaN and EPError on every rank",
               bool(torch.isnan(y_bad).all()) and f"{max(sizes)} tokens" in raised and elapsed < 10,
               f"({elapsed:.2f} s) {raised[:80]}...")
        got = run_layer(lay, x, dy)  # grows here, on every rank
        cuda_ep.check_errors(ws)
        want = run_layer(lays["reference"], x, dy)
        cap = ws.ep_state["bufs"].tokens_cap
        errs = {k: rel(got[k], want[k]) for k in want}
        ok = cap == max(sizes) and all(e < 2e-2 for e in errs.values()) and not any(
            torch.isnan(v).any() for v in got.values())
        report(f"growth ({label}): next call grows to {max(sizes)} and matches the reference", ok,
               f"capacity {cap}; " + " ".join(f"{k} {v:.1e}" for k, v in errs.items()))
        again = run_layer(lay, x0, dy0)
        cuda_ep.check_errors(ws)
        report(f"growth ({label}): the first batch gives the same bits at the new capacity",
               all(torch.equal(again[k], first[k]) for k in first))

    cap = cuda_ep.reserve_tokens(ws, [200, 10][rank])
    again = run_layer(lay, x0, dy0)
    cuda_ep.check_errors(ws)
    report("growth: reserve_tokens (collective) -> capacity 200, same bits",
           cap == 200 and all(torch.equal(again[k], first[k]) for k in first), f"capacity {cap}")


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
    raised = _ep_error(ws)
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


def case_cross_host_mode(name, H, I, E, K, T_by_rank, precision="bf16"):
    """The group made to look like two hosts (distributed.group_hosts patched): backend="auto" takes the portable
    backend's exchange over the group with its local experts on the kernels; against the symmetric-memory EP path
    (bf16 over NCCL) or the reference path (MXFP8, or a gloo group) within bf16 rounding; bitwise repeatable; the
    bounded and the host-split exchange give the same bits (docs/portable.md)."""
    from mok_nn import distributed

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    sd = MoKMoELayer(H, I, E, K, device="cuda", precision=precision).state_dict()
    g = torch.Generator(device="cuda").manual_seed(300 + rank)
    x = torch.randn(T_by_rank[rank], H, device="cuda", generator=g).to(torch.bfloat16)
    dy = torch.randn(T_by_rank[rank], H, device="cuda", generator=g).to(torch.bfloat16)

    def layer(backend, config=None):
        lay = MoKMoELayer(H, I, E, K, device="cuda", backend=backend, precision=precision,
                          ep_group=dist.group.WORLD, config=config)
        lay.load_state_dict(shard(sd, rank, E // world))
        return lay

    kernels = precision == "bf16" and dist.get_backend() == "nccl"
    want = run_layer(layer("cuda" if kernels else "reference"), x, dy)
    real = distributed.group_hosts
    distributed.group_hosts = lambda group: ["host-a", "host-b"]
    results = {}
    try:
        for mode, config in (("bounded", None), ("host-split", MoKConfig(schedule_capacity_multiplier=None))):
            lay = layer("auto", config)
            picked = (lay._choose_backend(x), lay._local_experts(x, lay._choose_backend(x)))
            got, again = run_layer(lay, x, dy), run_layer(lay, x, dy)
            errs = {k: rel(got[k], want[k]) for k in want}
            report(f"{name} ({mode}): auto picks the portable exchange with local experts on the kernels",
                   picked == ("torch", "cuda"), str(picked))
            report(f"{name} ({mode}): vs the {'EP kernels' if kernels else 'reference path'}",
                   all(e < 2e-2 for e in errs.values()) and not any(v.isnan().any() for v in got.values()),
                   " ".join(f"{k} {v:.1e}" for k, v in errs.items()))
            report(f"{name} ({mode}): bitwise identical across runs", all(torch.equal(got[k], again[k]) for k in got))
            results[mode] = got
    finally:
        distributed.group_hosts = real
    report(f"{name}: the bounded and the host-split exchange give the same bits",
           all(torch.equal(results["bounded"][k], results["host-split"][k]) for k in want))


def main():
    one_gpu = os.environ.get("MOK_EP_CHECK_ONE_GPU") == "1"
    dist.init_process_group("gloo" if one_gpu else "nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(0 if one_gpu else int(os.environ.get("LOCAL_RANK", rank)))
    if one_gpu:
        cross_host_checks()
    else:
        all_checks()
    dist.barrier()
    log(f"{sum(RESULTS)}/{len(RESULTS)} checks passed")
    out = os.environ.get("OUT", "/tmp")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"ep_cuda_check_rank{rank}.log"), "w") as f:
        f.write("\n".join(LOG) + "\n")
    dist.destroy_process_group()
    sys.exit(0 if RESULTS and all(RESULTS) else 1)


def cross_host_checks():
    check("cross host", lambda: case_cross_host_mode("cross-host mode", 512, 256, 32, 4, [1000, 777]))
    check("cross host mxfp8", lambda: case_cross_host_mode("cross-host mode, mxfp8", 512, 256, 32, 4, [700, 301],
                                                            precision="mxfp8"))


def all_checks():
    check("auto", case_auto_picks_cuda)
    check("default", lambda: case_vs_reference("swiglu", 512, 256, 32, 4, [1000, 777], {}))
    check("oai", lambda: case_vs_reference(
        "swiglu_oai+bias", 256, 128, 16, 4, [300, 301], dict(activation="swiglu_oai", swiglu_limit=7.0,
                                                               expert_proj_bias=True)))
    check("grouped", lambda: case_vs_reference(
        "sigmoid/groups/shared", 384, 192, 16, 4, [257, 1], dict(score_func="sigmoid", n_group=4, topk_group=2,
                                                                use_expert_bias=True, routed_scaling_factor=2.5,
                                                                shared_intermediate_size=64)))
    check("fixed swiglu", lambda: case_fixed_routing("swiglu", 512, 256, 32, 4, [1000, 777]))
    check("fixed limit", lambda: case_fixed_routing("swiglu limit 7", 384, 192, 16, 4, [257, 1], limit=7.0))
    check("fixed oai", lambda: case_fixed_routing(
        "gpt-oss (swiglu_oai, limit 7, biases)", 256, 128, 16, 4, [300, 301], activation="swiglu_oai", limit=7.0,
        bias=True))
    check("copy modes", lambda: case_copy_modes("copy modes", 2048, 256, 32, 8, [3000, 2001]))
    check("publish modes", lambda: case_publish_modes("publish modes", 2048, 256, 32, 8, [3000, 2001]))
    check("token rows modes", lambda: case_token_rows_modes("token rows modes", 2048, 256, 32, 8, [3000, 2001]))
    check("down push modes", lambda: case_down_push_modes("down push modes", 2048, 256, 32, 8, [3000, 2001]))
    check("down push 384", lambda: case_down_push_modes("down push modes, H 384, 257/1 tokens", 384, 192, 16, 4,
                                                        [257, 1]))
    check("two layers", lambda: case_two_layers("two layers, one workspace", 1024, 256, 32, 8, [1500, 1201]))
    check("macrobatch", lambda: case_macrobatch("macrobatch", 768, 256, 32, 8, 2500, 1024))
    cross_host_checks()
    check("overflow", case_overflow)
    check("growth", case_growth)
    check("shapes", case_shapes_differ)
    check("timeout", case_peer_timeout)  # last: leaves its own buffers out of step


if __name__ == "__main__":
    main()
