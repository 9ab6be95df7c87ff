"""Grouped GEMM with A rows gathered from x inside the kernel (mok_gemm_*_gather, MOK_GEMM_GATHER=1).

Each gather variant must give the bits of index_select (cb.gather_rows) + its TMA twin
(same K order, same MMAs), padding rows (zero-filled by cp.async) exactly 0, real rows within bf16 rounding of
an fp64 product, and the same bits on every repeat (5 launches: a missing barrier
arrive or proxy fence would show up as run-to-run differences). The experts and the
layer with MOK_GEMM_GATHER=1 / MOK_GEMM_GATHER_DY=1 must give the default path's bits.
"""

import pytest
import torch

from mok_nn.kernels import registry

from layer_runs import GRAD_NAMES, rel_err as rel_l2, run_layer, slot_products

cuda_ok = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
pytestmark = pytest.mark.skipif(not cuda_ok, reason="needs an sm_90 CUDA GPU")

BF16_TOL = 1e-2
REPEATS = 5

# gather variant -> (its TMA twin on the permuted copy, B read transposed (dgrad), output dtype)
TWINS = {
    "mok_gemm_bk_gather": ("mok_gemm_bk", False, torch.bfloat16),
    "mok_gemm_bk_ef_gather": ("mok_gemm_bk_ef", False, torch.bfloat16),
    "mok_gemm_bn_f32_gather": ("mok_gemm_bn_f32", True, torch.float32),
}


def test_gather_variants_listed():
    assert set(TWINS) == set(registry.GEMM_GATHER_KERNELS)


def _stream():
    return torch.cuda.current_stream().cuda_stream


def _launch_twin(name, a, W, transpose_w, out_dtype, sched, group_m):
    from mok_nn import cuda_backend as cb

    out = torch.full((a.shape[0], W.shape[2] if transpose_w else W.shape[1]), float("nan"), device="cuda",
                     dtype=out_dtype)
    b = W.permute(2, 1, 0) if transpose_w else W.permute(1, 2, 0)
    cb._lib().launch(name, a.unsqueeze(-1), b, out.unsqueeze(-1), sched.tile_expert, sched.seg_end,
                     sched.gemm_seg_rows(), group_m, stream=_stream())
    torch.cuda.synchronize()
    return out


def _launch_gather(name, x, W, transpose_w, out_dtype, sched, group_m):
    from mok_nn import cuda_backend as cb

    out = torch.full((sched.capacity, W.shape[2] if transpose_w else W.shape[1]), float("nan"), device="cuda",
                     dtype=out_dtype)
    b = W.permute(2, 1, 0) if transpose_w else W.permute(1, 2, 0)
    cb._lib().launch(name, x.unsqueeze(-1), sched.row_token, b, out.unsqueeze(-1), sched.tile_expert,
                     sched.seg_end, sched.gemm_seg_rows(), group_m, stream=_stream())
    torch.cuda.synchronize()
    return out


def _edge_routing(counts, seed):
    """Top-1 routing with the given rows per expert, tokens shuffled."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    flat = torch.repeat_interleave(torch.arange(len(counts), device="cuda"), torch.tensor(counts, device="cuda"))
    return flat[torch.randperm(flat.numel(), device="cuda", generator=g)].view(-1, 1)


def _random_routing(T, k, E, mode, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(T, E, device="cuda", generator=g)
    if mode == "skew":
        logits[:, E // 2 :] -= 30  # upper half of the experts gets no tokens
    return torch.topk(logits, k, dim=1).indices


EDGE_COUNTS = [1, 63, 0, 64, 65, 127, 128, 129, 200]  # rows per expert around the 64-row halves of a tile
CASES = [  # name, routing, N, K
    ("edges", ("edge", EDGE_COUNTS), 512, 320),
    ("edges_ktail", ("edge", EDGE_COUNTS), 384, 200),  # K % 64 = 8: last k tile mostly past K
    ("T1", ("random", 1, 1, 4, "random"), 256, 128),
    ("T333_skew", ("random", 333, 2, 8, "skew"), 1000, 72),  # N not a tile multiple, empty experts
    ("many_tiles", ("random", 2048, 4, 16, "random"), 1024, 512),  # several tiles per persistent CTA
    ("deepseek_like", ("random", 256, 8, 32, "random"), 512, 7168),  # 112 k tiles: stage ring wraps often
]


def _case_inputs(case, seed):
    from mok_nn import cuda_backend as cb

    _, routing, N, K = case
    if routing[0] == "edge":
        ids = _edge_routing(routing[1], seed)
        E = len(routing[1])
    else:
        _, T, k, E, mode = routing
        ids = _random_routing(T, k, E, mode, seed)
    sched = cb.make_schedule(ids, E)
    return ids, E, sched, N, K


@pytest.mark.parametrize("name", sorted(TWINS))
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_gather_equals_index_select(case, name):
    from mok_nn import cuda_backend as cb

    twin, transpose_w, out_dtype = TWINS[name]
    ids, E, sched, N, K = _case_inputs(case, seed=len(case[0]) * 7 + case[2])
    T = ids.shape[0]
    g = torch.Generator(device="cuda").manual_seed(K + N)
    x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16, generator=g)
    wshape = (E, K, N) if transpose_w else (E, N, K)
    W = (torch.randn(wshape, device="cuda", generator=g) / K**0.5).to(torch.bfloat16)
    used = int(sched.seg_end[-1])
    pos = sched.pos.reshape(-1)
    a = cb.gather_rows(x, sched)
    group_ms = [1, 3, 0] if case[0] in ("edges", "many_tiles", "deepseek_like") else [1]  # 0: expert bands
    for group_m in group_ms:
        want = _launch_twin(twin, a, W, transpose_w, out_dtype, sched, group_m)
        outs = [_launch_gather(name, x, W, transpose_w, out_dtype, sched, group_m) for _ in range(REPEATS)]
        got = outs[0]
        assert not torch.isnan(got[:used]).any(), f"group_m={group_m}: rows left unwritten"
        for o in outs[1:]:
            assert torch.equal(o[:used], got[:used]), f"group_m={group_m}: not bitwise reproducible"
        assert torch.equal(got[:used], want[:used]), f"group_m={group_m}: differs from {twin}"
    # independent check of the routed rows in fp64, padding rows exactly zero
    assert rel_l2(got[pos], slot_products(x, ids, W, transpose_w)) < BF16_TOL
    pad = torch.ones(used, dtype=torch.bool, device="cuda")
    pad[pos] = False
    assert torch.all(got[:used][pad] == 0), "padding rows not zero"


def test_backend_gather_helper(monkeypatch):
    """cb.grouped_gemm_gather (the wiring's entry) gives the bits of cb.grouped_gemm on the permuted copy."""
    from mok_nn import cuda_backend as cb

    ids = _random_routing(700, 4, 16, "random", seed=5)
    sched = cb.make_schedule(ids, 16)
    x = torch.randn(700, 384, device="cuda", dtype=torch.bfloat16)
    W = (torch.randn(16, 768, 384, device="cuda") / 20).to(torch.bfloat16)
    W2 = (torch.randn(16, 384, 256, device="cuda") / 20).to(torch.bfloat16)
    dy = torch.randn(700, 384, device="cuda", dtype=torch.bfloat16)
    used = int(sched.seg_end[-1])
    for epi in ("split", "full"):
        monkeypatch.setenv("MOK_GEMM_EPI", epi)
        got = cb.grouped_gemm_gather(x, W, sched, transpose_w=False)
        want = cb.grouped_gemm(cb.gather_rows(x, sched), W, sched, transpose_w=False)
        assert torch.equal(got[:used], want[:used]), epi
    got = cb.grouped_gemm_gather(dy, W2, sched, transpose_w=True, out_dtype=torch.float32)
    want = cb.grouped_gemm(cb.gather_rows(dy, sched), W2, sched, transpose_w=True, out_dtype=torch.float32)
    assert torch.equal(got[:used], want[:used])


EXPERT_CASES = [  # T, H, I, E, k, routing, activation, limit, bias
    (256, 256, 128, 8, 2, "random", "swiglu", None, False),
    (1, 256, 128, 8, 2, "random", "swiglu", None, False),
    (333, 512, 256, 16, 4, "skew", "swiglu", 7.0, False),
    (200, 256, 192, 4, 2, "random", "swiglu_oai", 7.0, True),
    (256, 7168, 2048, 32, 8, "random", "swiglu", None, False),  # deepseek-v3 sizes, reduced T and E
]


@pytest.mark.parametrize("act_mode", ["split", "fused"])
@pytest.mark.parametrize("case", EXPERT_CASES, ids=lambda c: f"T{c[0]}H{c[1]}I{c[2]}E{c[3]}k{c[4]}-{c[6]}-b{int(c[8])}")
def test_experts_gather_bitwise(case, act_mode, monkeypatch):
    """experts_forward / experts_backward with MOK_GEMM_GATHER=1 and MOK_GEMM_GATHER_DY=1: the default's bits,
    and the forward keeps no permuted copy of x (split activation)."""
    from mok_nn import cuda_backend as cb

    T, H, I, E, k, mode, act, limit, bias = case
    monkeypatch.setenv("MOK_GEMM_ACT", act_mode)
    # MOK_GEMM_GATHER_DY runs the split dgrad + activation backward (the fused one has no gather
    # variant), whose d topk-weight sums in another order: compare like with like
    monkeypatch.setenv("MOK_GEMM_DACT", "split")
    g = torch.Generator(device="cuda").manual_seed(T * 7 + H)
    ids = _random_routing(T, k, E, mode, seed=T + E)
    w = torch.rand(T, k, device="cuda", generator=g)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=g)
    W13 = (torch.randn(E, 2 * I, H, device="cuda", generator=g) / H**0.5).to(torch.bfloat16)
    W2 = (torch.randn(E, H, I, device="cuda", generator=g) / I**0.5).to(torch.bfloat16)
    b13 = (0.1 * torch.randn(E, 2 * I, device="cuda", generator=g)).to(torch.bfloat16) if bias else None
    b2 = (0.1 * torch.randn(E, H, device="cuda", generator=g)).to(torch.bfloat16) if bias else None
    dy = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=g)
    args = (W13, W2, b13, b2, act, limit)

    def run():
        y, saved = cb.experts_forward(x, ids, w, *args)
        dx, dw, grads = cb.experts_backward(dy, saved, x, ids, w, *args)
        torch.cuda.synchronize()
        return saved, [y, dx, dw, grads.gate_up_proj, grads.down_proj, grads.gate_up_bias, grads.down_bias]

    _, want = run()
    monkeypatch.setenv("MOK_GEMM_GATHER", "1")
    monkeypatch.setenv("MOK_GEMM_GATHER_DY", "1")
    for _ in range(2):
        saved, got = run()
        assert saved.x_rows is None, "the forward kept the permuted copy of x"
        names = ["y", "dx", "d_topk", "d_gate_up_proj", "d_down_proj", "d_gate_up_bias", "d_down_bias"]
        for n, a, b in zip(names, got, want):
            if b is not None:
                assert torch.equal(a, b), f"{n} differs from the default path"


@pytest.mark.parametrize("T", [1, 777])
def test_layer_gather_bitwise(T, monkeypatch):
    """MoKMoELayer(backend="cuda") forward+backward: MOK_GEMM_GATHER=1 (+ _DY) gives the default path's bits."""
    from mok_nn import MoKMoELayer

    torch.manual_seed(0)
    layer = MoKMoELayer(256, 128, 16, 4, device="cuda", backend="cuda")
    x = torch.randn(T, 256, device="cuda").to(torch.bfloat16)
    dy = torch.randn(T, 256, device="cuda").to(torch.bfloat16)
    want = run_layer(layer, x, dy)
    monkeypatch.setenv("MOK_GEMM_GATHER", "1")
    monkeypatch.setenv("MOK_GEMM_GATHER_DY", "1")
    got = run_layer(layer, x, dy)
    for name, a, b in zip(GRAD_NAMES, got, want):
        assert torch.equal(a, b), name
