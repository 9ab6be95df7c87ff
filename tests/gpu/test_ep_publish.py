"""mok_ep_publish (kernels/ep_publish.py) on ONE GPU (needs sm_90): step 1 of the EP forward against
the torch ops it replaces (SymmBuffers.publish_torch) and against the values it must store.

The P ranks' buffers are ordinary local tensors (the kernel only sees their addresses), every byte
poisoned first (0x7f, or a NaN pattern). Inputs are fresh random rows / ids / weights with -0.0, inf,
NaN payloads and denormals among the weights. Checked bitwise: every rank's whole buffer equals the
torch ops' result (nothing else written), the published sections hold x / ids (-1 past n) / fp32
weights (bf16 widened by integer shifts, computed here) / the token count, on grids of 1, 3 and the
auto grid CTAs, and a repeat gives the same bytes.
"""

import os
import time

import pytest
import torch

from mok_nn import cuda_ep

cuda_ok = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
pytestmark = pytest.mark.skipif(not cuda_ok, reason="needs an sm_90 CUDA GPU")

TABLE = ("ids", "weights", "ntok")


@pytest.fixture(scope="module")
def lib():
    from mok_nn.kernels import loader

    return loader.load("sm_90a", lib_dir=os.environ.get("MOK_KERNEL_DIR"))


def _raws(P, tc, H, K, poison):
    """Every rank's buffer, all bytes poisoned: 0x7f, or the words 0x7fc00001 (fp32 NaN; bf16 NaN and
    a denormal; int64 a large id)."""
    _, nbytes = cuda_ep.buffer_layout(P, tc, H, K)
    if poison == "7f":
        return [torch.full((nbytes,), 0x7F, dtype=torch.uint8, device="cuda") for _ in range(P)]
    word = torch.tensor([0x7FC00001], dtype=torch.int32, device="cuda")
    return [word.repeat(nbytes // 4).view(torch.uint8) for _ in range(P)]


def _weights(g, T, K, dtype):
    w = (torch.rand(T, K, device="cuda", generator=g, dtype=torch.float64) * 3 - 1).to(dtype)
    flat = w.view(-1)
    if flat.numel() >= 8:
        flat[:4] = torch.tensor([-0.0, float("inf"), -1e-40, float("nan")], dtype=torch.float64).to(dtype)
        if dtype == torch.bfloat16:
            flat.view(torch.int16)[5] = 0x7FC3  # NaN with payload bits
        elif dtype == torch.float32:
            flat.view(torch.int32)[5] = -0x003FFEDD  # 0xffc00123: negative NaN with payload
    return w


def _inputs(T, H, K, wdtype, strided, seed):
    """x [T, H] bf16, ids [T, K] int64, w [T, K]: fresh random; strided: column windows of wider
    tensors (x's rows 16-byte aligned, row stride H + 16), so the kernel must use the strides."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    if strided:
        x = torch.randn(T, H + 16, device="cuda", generator=g).to(torch.bfloat16)[:, 8:8 + H]
        ids = torch.randint(0, 256, (T, K + 3), device="cuda", generator=g)[:, 1:K + 1]
        w = _weights(g, T, 2 * K, wdtype)[:, ::2]
    else:
        x = torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16)
        ids = torch.randint(0, 256, (T, K), device="cuda", generator=g)
        w = _weights(g, T, K, wdtype)
    return x, ids, w


def _fp32_bits(w):
    """[T, K] int32: the fp32 bits copy_ must store, computed without a float conversion for bf16 /
    fp32 (bf16: its 16 bits in the high half)."""
    if w.dtype == torch.bfloat16:
        return (w.contiguous().view(torch.int16).to(torch.int32) << 16)
    if w.dtype == torch.float32:
        return w.contiguous().view(torch.int32)
    return w.float().view(torch.int32)  # fp16 exact, fp64 rounded to nearest even (torch's conversion)


def _bufs(raws, rank, tc, H, K):
    return cuda_ep.SymmBuffers(raws, rank, tc, H, K, torch.device("cuda"))


def _launch(lib, bufs, x, ids, w, num_tokens, grid, epoch=0, timeout_us=1, arrivals=None, stream=None, push=False):
    """mok_ep_publish directly on a given grid (SymmBuffers.publish picks the grid itself); epoch > 0:
    ending with the barrier of that epoch (arrivals: the CTA counter, zero); push: the rows into every
    rank's tokens section."""
    assert cuda_ep.publish_kernel_ok(x)
    if w.dtype != torch.float32:
        w = w.float()  # (as SymmBuffers.publish converts them: the kernel takes fp32)
    if arrivals is None:
        arrivals = torch.zeros(1, dtype=torch.int32, device="cuda")
    stream = stream or torch.cuda.current_stream()
    lib.launch("mok_ep_publish", x, ids, w, bufs.local("tokens"), bufs.section_table(TABLE), bufs.rank, bufs.tokens_cap,
               num_tokens, grid, bufs.section_addrs("pad"), bufs.err, arrivals, epoch, timeout_us,
               bufs.section_addrs("tokens"), int(push), 2**31 - 1, stream=stream.cuda_stream)


def _check_sections(raws, rank, tc, H, K, x, ids, w, num_tokens, push=False):
    """The published values, read back from every rank's buffer."""
    n = min(num_tokens, tc)
    P = len(raws)
    bufs = _bufs(raws, rank, tc, H, K)
    for p in range(P) if push else [rank]:
        tok = bufs.peer(p, "tokens")[rank * tc:rank * tc + n]
        assert torch.equal(tok.view(torch.int16), x[:n].contiguous().view(torch.int16)), p
    want_w = _fp32_bits(w[:n]).flatten()
    for p in range(P):
        ids_p = bufs.peer(p, "ids")[rank]
        assert torch.equal(ids_p[:n], ids[:n]), p
        assert bool((ids_p[n:] == -1).all()), p
        w_p = bufs.peer(p, "weights")[rank * tc * K:(rank * tc + n) * K]
        assert torch.equal(w_p.view(torch.int32), want_w), p
        assert int(bufs.peer(p, "ntok")[rank]) == num_tokens, p


def _case(lib, monkeypatch, P, rank, tc, num_tokens, H, K, wdtype, poison, strided=False, grids=("auto",),
          push=False):
    x, ids, w = _inputs(num_tokens, H, K, wdtype, strided, seed=P * 1000 + tc + num_tokens + H)
    ref = _raws(P, tc, H, K, poison)
    _bufs(ref, rank, tc, H, K).publish_torch(x, ids, w, num_tokens, push_rows=push)
    fresh = _raws(P, tc, H, K, poison)
    torch.cuda.synchronize()
    for p in range(P):
        assert not torch.equal(ref[p], fresh[p]), p  # every rank got something
    del fresh
    _check_sections(ref, rank, tc, H, K, x, ids, w, num_tokens, push)  # the oracle itself
    monkeypatch.delenv("MOK_EP_COPY", raising=False)  # (MOK_EP_COPY=torch: the torch ops publish)
    for grid in grids:
        for _ in range(2):  # a repeat: the same bytes
            raws = _raws(P, tc, H, K, poison)
            bufs = _bufs(raws, rank, tc, H, K)
            if grid == "auto":
                bufs.publish(x, ids, w, num_tokens, push_rows=push)  # the layer's call (its grid)
            else:
                _launch(lib, bufs, x, ids, w, num_tokens, grid, push=push)
            torch.cuda.synchronize()
            for p in range(P):
                assert torch.equal(raws[p], ref[p]), (grid, p)
            _check_sections(raws, rank, tc, H, K, x, ids, w, num_tokens, push)


@pytest.mark.parametrize("H", [8, 2048, 7168])
@pytest.mark.parametrize("P,rank", [(1, 0), (2, 1), (4, 2)])
@pytest.mark.parametrize("tc,num_tokens", [(64, 64), (64, 37), (64, 100), (1000, 1000), (1000, 517)])
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("poison", ["7f", "nan"])
def test_publish_equals_torch(lib, monkeypatch, H, P, rank, tc, num_tokens, wdtype, poison):
    _case(lib, monkeypatch, P, rank, tc, num_tokens, H, 8, wdtype, poison)


@pytest.mark.parametrize("push", [False, True])
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("strided", [False, True])
def test_publish_grids_dtypes_strides(lib, monkeypatch, wdtype, strided, push):
    """Grids of 1 and 3 CTAs (each CTA walks many rows / elements) and the auto grid; fp16 / fp64
    weights (converted to fp32 by the caller first); inputs that are column windows; push: the rows into
    every rank's tokens section (rows of 1000 columns: a partial last chunk of 16-byte vectors)."""
    _case(lib, monkeypatch, 3, 1, 300, 211, 1000 if not strided else 2048, 6, wdtype, "nan", strided,
          grids=(1, 3, "auto"), push=push)


@pytest.mark.parametrize("push", [False, True])
@pytest.mark.parametrize("H,K", [(7168, 8), (2048, 8)])
def test_publish_full_size(lib, monkeypatch, H, K, push):
    """The benchmark size: 8192 tokens per rank, EP = 2, both ranks' sides."""
    for rank in (0, 1):
        _case(lib, monkeypatch, 2, rank, 8192, 8192, H, K, torch.float32, "7f", push=push)


def test_publish_no_tokens(lib, monkeypatch):
    """A rank with no tokens: ids all -1, the count 0, no row or weight written."""
    _case(lib, monkeypatch, 2, 0, 16, 0, 64, 4, torch.float32, "nan")


@pytest.mark.parametrize("grid", [1, 3, 64])
def test_publish_ends_with_the_barrier(lib, grid):
    """epoch > 0 (the forward's steps 1 and 2 in one launch): two ranks of P = 2 simulated on two streams
    of this GPU, launched one after the other, wait for each other at the end and both finish without
    error; each one's epoch is in the other's pad slot, the CTA counters are back at 0, and every other
    byte of both buffers is what the torch ops publish (the barrier writes nothing else)."""
    P, tc, H, K, epoch = 2, 300, 1024, 6, 5
    raws, ref = _raws(P, tc, H, K, "nan"), _raws(P, tc, H, K, "nan")
    for buf in raws + ref:
        _bufs([buf] * P, 0, tc, H, K).local("pad").zero_()  # a fresh workspace's pads are zero
    inputs = [_inputs(n, H, K, torch.float32, False, seed=40 + r) for r, n in enumerate((300, 211))]
    counters = [torch.zeros(1, dtype=torch.int32, device="cuda") for _ in range(P)]
    streams = [torch.cuda.Stream() for _ in range(P)]
    bufs = [_bufs(raws, r, tc, H, K) for r in range(P)]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())  # the zeroed pads, counters and error flags first
    for r in range(P):
        x, ids, w = inputs[r]
        _launch(lib, bufs[r], x, ids, w, x.shape[0], grid, epoch, 10_000_000, counters[r], streams[r])
        if r == 0:  # rank 0's launch is done in us unless it waits at the barrier for rank 1's signal
            time.sleep(0.05)
            assert not streams[0].query(), "rank 0 did not wait for its peer"
    torch.cuda.synchronize()
    for r in range(P):
        x, ids, w = inputs[r]
        _bufs(ref, r, tc, H, K).publish_torch(x, ids, w, x.shape[0])
        assert int(bufs[r].err[0]) == 0, r
        assert int(counters[r][0]) == 0, r  # reset by the last CTA for the next launch
        assert int(bufs[r].local("pad")[1 - r]) == epoch, r  # the peer's signal
        assert int(bufs[r].local("pad")[r]) == 0, r  # no rank signals itself
    for r in range(P):
        _bufs(ref, r, tc, H, K).local("pad")[1 - r] = epoch
    torch.cuda.synchronize()
    for r in range(P):
        assert torch.equal(raws[r], ref[r]), r


def test_publish_barrier_times_out_with_a_flag(lib):
    """A peer that never signals: the launch ends after timeout_us with err[0] = 1 (no hang), the counter
    back at 0, this rank's signal in the peer's pad all the same."""
    P, tc, H, K = 2, 16, 64, 4
    raws = _raws(P, tc, H, K, "7f")
    for buf in raws:
        _bufs([buf] * P, 0, tc, H, K).local("pad").zero_()
    bufs = _bufs(raws, 1, tc, H, K)
    x, ids, w = _inputs(16, H, K, torch.float32, False, seed=3)
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    torch.cuda.synchronize()
    _launch(lib, bufs, x, ids, w, 16, 3, epoch=1, timeout_us=2000, arrivals=counter)
    torch.cuda.synchronize()
    assert int(bufs.err[0]) == 1 and int(counter[0]) == 0
    assert int(_bufs(raws, 0, tc, H, K).local("pad")[1]) == 1


_BAD_ID_SCRIPT = """
import sys, torch
from mok_nn import cuda_ep
P, tc, H, K, E = 2, 64, 64, 2, 8
bad, slot = int(sys.argv[1]), int(sys.argv[2])
_, nbytes = cuda_ep.buffer_layout(P, tc, H, K)
raws = [torch.zeros(nbytes, dtype=torch.uint8, device="cuda") for _ in range(P)]
bufs = cuda_ep.SymmBuffers(raws, 0, tc, H, K, torch.device("cuda"))
g = torch.Generator(device="cuda").manual_seed(0)
x = torch.randn(50, H, device="cuda", generator=g).bfloat16()
ids = torch.randint(0, E, (50, K), device="cuda", generator=g)
ids.view(-1)[slot] = bad
w = torch.rand(50, K, device="cuda", generator=g)
bufs.publish(x, ids, w, 50, num_experts=E)
torch.cuda.synchronize()
print("NO ERROR", flush=True)
"""


@pytest.mark.parametrize("bad", [8, -1, -2])
def test_publish_stops_on_expert_id_out_of_range(monkeypatch, bad):
    """An id outside [0, E) in the tokens being published stops mok_ep_publish (printed, then a trap;
    kernels/id_check.py) before any rank could use it: at EP > 1 these ids would otherwise pass a torch
    table lookup that takes E as 'no token' and wraps negative ids to other experts. Child process: the trap
    ends the CUDA context. Ids past the token count (-1, written by the kernel itself) are not checked."""
    import subprocess
    import sys

    slot = 77  # token 38, j = 1
    env = {k: v for k, v in os.environ.items() if k != "MOK_EP_COPY"}  # the kernel publishes
    run = subprocess.run([sys.executable, "-c", _BAD_ID_SCRIPT, str(bad), str(slot)], env=env, capture_output=True,
                         text=True, timeout=120)
    out = run.stdout + run.stderr
    assert run.returncode != 0 and "NO ERROR" not in out, out[-2000:]
    assert f"mok_nn: expert id {bad} of slot {slot} (token * top_k + j) is outside [0, 8)" in out, out[-2000:]
