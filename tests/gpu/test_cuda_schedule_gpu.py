"""The schedule kernels (mok_schedule_mc, mok_schedule_gather) == make_schedule_torch, exactly (needs an sm_90 GPU).

Outputs and the scratch are poisoned before each launch; each kernel runs twice
and must give the same bits. The oracle is the torch schedule (a stable sort),
plus per-expert counts from bincount for seg_rows, and index_select for the gathered rows.
"""

import pytest
import torch

cuda_ok = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
pytestmark = pytest.mark.skipif(not cuda_ok, reason="needs an sm_90 CUDA GPU")

FIELDS = ("pos", "row_token", "tile_expert", "seg_end", "seg_rows")


@pytest.fixture(scope="module")
def lib():
    from mok_nn import cuda_backend as cb

    return cb._lib()


def _ids(num_tokens, top_k, num_experts, mode, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    if mode == "all_one":  # every slot on one expert (the last)
        return torch.full((num_tokens, top_k), num_experts - 1, dtype=torch.int64, device="cuda")
    logits = torch.randn(num_tokens, num_experts, device="cuda", generator=g)
    if mode == "hot":  # expert 1 in every token's top-k, the rest random
        logits[:, 1] += 100
    elif mode == "sparse":  # only every 7th expert gets tokens, the rest are empty
        logits[:, torch.arange(num_experts, device="cuda") % 7 != 0] -= 100
    ids = torch.topk(logits, min(top_k, num_experts), dim=1).indices
    if ids.shape[1] < top_k:  # k > E: repeat experts (the schedule does not need distinct ids)
        ids = ids.repeat(1, -(-top_k // ids.shape[1]))[:, :top_k]
    return ids.contiguous()


def _run_kernel(lib, ids, num_experts, poison):
    """One launch of mok_schedule_mc into poisoned outputs, scratch included (mirrors cuda_backend.make_schedule)."""
    from mok_nn import cuda_backend as cb

    num_tokens, top_k = ids.shape
    n = num_tokens * top_k
    cap = cb.schedule_capacity(num_tokens, top_k, num_experts)
    dev = ids.device
    out = {
        "pos": torch.full((n,), poison, dtype=torch.int64, device=dev),
        "row_token": torch.full((cap,), poison, dtype=torch.int64, device=dev),
        "tile_expert": torch.full((cap // cb.TILE_M,), poison, dtype=torch.int32, device=dev),
        "seg_end": torch.full((num_experts,), poison, dtype=torch.int32, device=dev),
        "seg_rows": torch.full((num_experts,), poison, dtype=torch.int32, device=dev),
        "padded_rows": torch.full((num_experts,), poison, dtype=torch.int32, device=dev),
    }
    args = (ids.reshape(-1), *out.values())
    chunk, chunks = cb.schedule_chunk(n)
    scratch = torch.full((chunks * num_experts,), poison, dtype=torch.int32, device=dev)
    lib.launch("mok_schedule_mc", *args, scratch, top_k, chunk, stream=torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    out["pos"] = out["pos"].view(num_tokens, top_k)
    return out


CASES = [  # T, k, E, routing
    (1, 1, 8, "random"), (1, 8, 512, "random"), (1, 2, 128, "all_one"),
    (333, 1, 8, "random"), (333, 2, 8, "hot"), (333, 8, 128, "sparse"), (333, 8, 256, "random"),
    (333, 2, 512, "all_one"), (1000, 8, 512, "sparse"),
    (4096, 8, 128, "hot"), (4096, 8, 256, "sparse"), (4096, 2, 512, "random"),
    (8192, 8, 128, "random"), (8192, 8, 256, "random"), (8192, 2, 8, "random"),  # the benchmark shapes
    (8192, 8, 512, "hot"), (8192, 1, 8, "all_one"), (8191, 8, 128, "all_one"),
    (65536, 8, 128, "random"),  # 524288 slots: 8 groups of 32 per warp in each chunk
    (50000, 8, 512, "sparse"),
]


@pytest.mark.parametrize("T,k,E,mode", CASES)
def test_schedule_kernel_exact(lib, T, k, E, mode):
    from mok_nn import cuda_backend as cb

    ids = _ids(T, k, E, mode, seed=T * 131 + k * 7 + E)
    want = cb.make_schedule_torch(ids, E)
    assert torch.equal(want.seg_rows.long(), torch.bincount(ids.reshape(-1), minlength=E))
    first = _run_kernel(lib, ids, E, poison=-7)
    second = _run_kernel(lib, ids, E, poison=123456)  # other poison: every element must be written
    for f in FIELDS:
        assert first[f].dtype == getattr(want, f).dtype, f
        assert torch.equal(first[f], getattr(want, f)), (f, mode)
        assert torch.equal(first[f], second[f]), f
    # each segment's size (the GEMMs' seg_rows), from the torch schedule's segment ends
    assert torch.equal(first["padded_rows"], cb.padded_seg_rows(want.seg_end))
    assert torch.equal(first["padded_rows"], second["padded_rows"])


def test_schedule_kernel_random_shapes(lib):
    # many odd shapes: any T, k, E <= 512, uniform random ids (repeats within a token allowed)
    from mok_nn import cuda_backend as cb

    g = torch.Generator().manual_seed(2026)
    for _ in range(40):
        T = int(torch.randint(1, 20000, (1,), generator=g))
        k = int(torch.randint(1, 9, (1,), generator=g))
        E = int(torch.randint(1, 513, (1,), generator=g))
        ids = torch.randint(0, E, (T, k), generator=g).cuda()
        want = cb.make_schedule_torch(ids, E)
        got = _run_kernel(lib, ids, E, poison=-3)
        for f in FIELDS:
            assert torch.equal(got[f], getattr(want, f)), (f, T, k, E)
        assert torch.equal(got["padded_rows"], cb.padded_seg_rows(want.seg_end)), (T, k, E)


@pytest.mark.parametrize("E", [128, 512, 513])
def test_make_schedule_runs_the_kernels(lib, launched_kernels, E):
    """make_schedule on CUDA: mok_schedule_mc where the kernel's tables hold the experts (E <= 512), with
    gather_x mok_schedule_gather, else make_schedule_torch (no launch); the same schedule every way."""
    from mok_nn import cuda_backend as cb

    ids = _ids(777, 8, E, "random", seed=5)
    x = torch.randn(777, 64, device="cuda").to(torch.bfloat16)
    want = cb.make_schedule_torch(ids, E)
    kernel = E <= cb.SCHEDULE_MAX_EXPERTS
    for gather, name in ((None, "mok_schedule_mc"), (x, "mok_schedule_gather")):
        launched_kernels.clear()
        got = cb.make_schedule(ids, E, gather_x=gather)
        torch.cuda.synchronize()
        assert launched_kernels == ([name] if kernel else []), launched_kernels
        assert (got.gathered is not None) == (kernel and gather is not None)
        for f in FIELDS:
            assert torch.equal(getattr(got, f), getattr(want, f)), (name, f)
        if kernel:
            assert torch.equal(got.gemm_seg_rows(), cb.padded_seg_rows(want.seg_end))


def test_schedule_no_host_sync(lib):
    # the kernel path (with and without the gather) reads nothing back: it runs under sync debug mode "error"
    from mok_nn import cuda_backend as cb

    ids = _ids(4096, 8, 128, "random", seed=9)
    x = torch.randn(4096, 256, device="cuda").to(torch.bfloat16)
    cb.make_schedule(ids, 128, gather_x=x)  # first call may load the library
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        sched = cb.make_schedule(ids, 128)
        with_x = cb.make_schedule(ids, 128, gather_x=x)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    want = cb.make_schedule_torch(ids, 128)
    assert torch.equal(sched.seg_rows, want.seg_rows) and torch.equal(with_x.seg_rows, want.seg_rows)
    assert with_x.gathered is not None


@pytest.mark.parametrize("T,k,E,mode", [(1, 1, 8, "random"), (333, 8, 128, "sparse"), (8192, 8, 256, "random"),
                                        (4096, 2, 8, "hot"), (8191, 8, 128, "all_one")])
def test_schedule_gather_equals_schedule_then_gather(lib, T, k, E, mode):
    # mok_schedule_gather (make_schedule(gather_x=x)): the schedule of mok_schedule_mc, and x rows in
    # schedule order as gather_rows gives them, against make_schedule_torch and an index_select oracle
    from mok_nn import cuda_backend as cb

    ids = _ids(T, k, E, mode, seed=T + 17 * E)
    g = torch.Generator(device="cuda").manual_seed(T)
    x = torch.randn(T, 200, device="cuda", generator=g).to(torch.bfloat16)
    want = cb.make_schedule_torch(ids, E)
    for rep in range(2):
        got = cb.make_schedule(ids, E, gather_x=x)
        assert got.gathered is not None  # the fused call ran
        assert got.take_gathered(x.clone()) is None and got.gathered is None  # another tensor: not its rows
        got = cb.make_schedule(ids, E, gather_x=x)
        rows = got.take_gathered(x)
        for f in FIELDS:
            assert torch.equal(getattr(got, f), getattr(want, f)), (f, rep)
        live = int((got.tile_expert >= 0).sum()) * cb.TILE_M  # rows of tiles past the last segment: unwritten
        oracle = torch.cat([x, x.new_zeros(1, x.shape[1])]).index_select(0, want.row_token[:live])
        assert torch.equal(rows[:live], oracle), rep
        assert torch.equal(rows[:live], cb.gather_rows(x, got, skip_tail=True)[:live])


def test_schedule_gather_only_where_the_scatter_runs(lib):
    """make_schedule(gather_x=x) gathers where take_rows would run mok_scatter_rows on x: 16-byte rows, one x
    row per token, top_k <= 32; elsewhere nothing is gathered (the forward then gathers on its own)."""
    from mok_nn import cuda_backend as cb

    ids = _ids(64, 2, 8, "random", seed=5)
    x = torch.randn(64, 64, device="cuda").to(torch.bfloat16)
    assert cb.make_schedule(ids, 8, gather_x=x).gathered is not None
    assert cb.make_schedule(ids, 8, gather_x=x[:, 1:]).gathered is None  # rows not 16-byte vectors
    assert cb.make_schedule(ids, 8, gather_x=x[:32]).gathered is None  # not one row per token
    assert cb.make_schedule(ids, 8, gather_x=x.float()).gathered is None  # not bf16
    wide = _ids(64, 33, 64, "random", seed=6)  # top_k > 32: mok_gather_rows would gather
    assert cb.make_schedule(wide, 64, gather_x=x).gathered is None


_BAD_ID_SCRIPT = """
import sys, torch
from mok_nn import cuda_backend as cb
num_experts, bad, slot, gather = 8, int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
g = torch.Generator(device="cuda").manual_seed(0)
ids = torch.randint(0, num_experts, (300, 2), device="cuda", generator=g)
ids.view(-1)[slot] = bad
x = torch.randn(300, 64, device="cuda").bfloat16()
sched = cb.make_schedule(ids, num_experts, gather_x=x if gather else None)
torch.cuda.synchronize()
print("NO ERROR", flush=True)
"""


@pytest.mark.parametrize("gather", ["1", "0"])  # mok_schedule_gather, mok_schedule_mc
@pytest.mark.parametrize("bad", [8, -1, 2**40])
def test_schedule_stops_on_expert_id_out_of_range(gather, bad):
    """An id outside [0, E) stops the schedule kernel (printed, then a trap): the process sees a CUDA error at
    its next synchronisation and the message names the id and its slot, instead of a schedule built on an
    out-of-bounds count. A child process runs it: the trap ends the CUDA context. Valid ids are the other tests."""
    import subprocess
    import sys

    slot = 417  # token 208, j = 1
    run = subprocess.run([sys.executable, "-c", _BAD_ID_SCRIPT, str(bad), str(slot), gather], capture_output=True,
                         text=True, timeout=120)
    out = run.stdout + run.stderr
    assert run.returncode != 0 and "NO ERROR" not in out, out[-2000:]
    assert f"mok_nn: expert id {bad} of slot {slot} (token * top_k + j) is outside [0, 8)" in out, out[-2000:]
    assert "CUDA error" in out or "launch failure" in out, out[-2000:]
