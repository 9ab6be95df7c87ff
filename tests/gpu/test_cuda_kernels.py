"""CuTe DSL kernels and the CUDA experts path against fp64/fp32 oracles (needs an sm_90 GPU).

MOK_KERNEL_DIR names a prebuilt library folder; otherwise the loader's search applies.
Outputs are poisoned (NaN) before each run; each result is checked twice for
bitwise equality.
"""

import os

import pytest
import torch

cuda_ok = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
pytestmark = pytest.mark.skipif(not cuda_ok, reason="needs an sm_90 CUDA GPU")

BF16_TOL = 1e-2  # relative L2 error allowed for bf16 operands / outputs


def rel_l2(a, b):
    """||a - b|| / ||b|| in fp64, in chunks along dim 0 (weight gradients can be large)."""
    assert a.shape == b.shape, (a.shape, b.shape)
    num = den = 0.0
    for u, v in zip(a.reshape(a.shape[0], -1).split(16), b.reshape(b.shape[0], -1).split(16)):
        u, v = u.double(), v.double()
        num += (u - v).pow(2).sum().item()
        den += v.pow(2).sum().item()
    return (num / max(den, 1e-300)) ** 0.5


@pytest.fixture(scope="module")
def lib():
    from mok_nn.kernels import loader

    return loader.load("sm_90a", lib_dir=os.environ.get("MOK_KERNEL_DIR"))


def _routing(num_tokens, top_k, num_experts, mode, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    if mode == "one_expert":
        ids = torch.zeros(num_tokens, top_k, dtype=torch.int64, device="cuda")
        ids += torch.arange(top_k, device="cuda")  # slot j -> expert j; expert 0 takes every token
    else:
        logits = torch.randn(num_tokens, num_experts, device="cuda", generator=g)
        if mode == "skew":
            logits[:, num_experts // 2 :] -= 30  # upper half of the experts gets no tokens
        ids = torch.topk(logits, top_k, dim=1).indices
    w = torch.rand(num_tokens, top_k, device="cuda", generator=g)
    return ids, w


GEMM_CASES = [  # tokens, k, E, N, K, routing
    (256, 2, 8, 512, 256, "random"),
    (1, 1, 4, 256, 128, "random"),
    (333, 2, 8, 384, 200, "skew"),
    (300, 1, 3, 1000, 72, "one_expert"),
]


@pytest.mark.parametrize("transpose_w,out_dtype", [(False, torch.bfloat16), (True, torch.bfloat16), (True, torch.float32)])
@pytest.mark.parametrize("case", GEMM_CASES)
def test_grouped_gemm(lib, case, transpose_w, out_dtype):
    from mok_nn import cuda_backend as cb

    T, k, E, N, K, mode = case
    ids, w = _routing(T, k, E, mode, seed=T + N)
    sched = cb.make_schedule(ids, E)
    x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
    a = cb.gather_rows(x, sched)
    wshape = (E, K, N) if transpose_w else (E, N, K)
    W = torch.randn(wshape, device="cuda", dtype=torch.bfloat16) / K**0.5
    pos = sched.pos.reshape(-1)
    outs = []
    for _ in range(2):
        out = torch.full((a.shape[0], N), float("nan"), device="cuda", dtype=out_dtype)
        name = ("mok_gemm_bn_f32" if out_dtype == torch.float32 else "mok_gemm_bn") if transpose_w else "mok_gemm_bk"
        b = W.permute(2, 1, 0) if transpose_w else W.permute(1, 2, 0)
        lib.launch(name, a.unsqueeze(-1), b, out.unsqueeze(-1), sched.tile_expert, stream=torch.cuda.current_stream().cuda_stream)
        torch.cuda.synchronize()
        outs.append(out)
    assert torch.equal(outs[0][pos], outs[1][pos]), "not bitwise reproducible"
    got = outs[0][pos]
    Wd = W.double()
    ref = torch.stack(
        [x[t].double() @ (Wd[e] if transpose_w else Wd[e].T) for t, e in zip(torch.arange(T).repeat_interleave(k).tolist(), ids.reshape(-1).tolist())]
    ) if T * k <= 64 else None
    if ref is None:
        xe = x.double()[torch.arange(T, device="cuda").repeat_interleave(k)]
        We = Wd[ids.reshape(-1)]
        ref = torch.einsum("rk,rkn->rn", xe, We) if transpose_w else torch.einsum("rk,rnk->rn", xe, We)
    assert not torch.isnan(got).any(), "rows left unwritten"
    err = rel_l2(got, ref)
    assert err < BF16_TOL, err
    # padding rows inside segments see zero inputs -> exactly zero outputs
    seg_rows = torch.zeros(a.shape[0], dtype=torch.bool, device="cuda")
    used = int(sched.seg_end[-1])
    seg_rows[:used] = True
    seg_rows[pos] = False
    assert torch.all(outs[0][seg_rows] == 0)


@pytest.mark.parametrize("T,k,H", [(1, 1, 8), (513, 8, 2048), (64, 2, 7168)])
def test_combine(lib, T, k, H):
    from mok_nn import cuda_backend as cb

    R = T * k + 5
    rows = torch.randn(R, H, device="cuda", dtype=torch.bfloat16)
    pos = torch.randperm(R, device="cuda")[: T * k].view(T, k)
    w = torch.rand(T, k, device="cuda")
    ys = [cb.combine(rows, pos, w, torch.bfloat16) for _ in range(2)]
    assert torch.equal(ys[0], ys[1])
    ref = (rows.double()[pos] * w.double()[..., None]).sum(1)
    assert rel_l2(ys[0], ref) < 5e-3  # one bf16 rounding of the fp32 sum


EXPERT_CASES = [  # T, H, I, E, k, routing, activation, limit, bias
    (256, 256, 128, 8, 2, "random", "swiglu", None, False),
    (1, 256, 128, 8, 2, "random", "swiglu", None, False),
    (300, 512, 256, 16, 4, "skew", "swiglu", 7.0, False),
    (200, 256, 192, 4, 2, "one_expert", "swiglu_oai", 7.0, True),
    (512, 2048, 768, 128, 8, "random", "swiglu", None, False),  # qwen3-30b-a3b, reduced T
    (256, 7168, 2048, 256, 8, "random", "swiglu", None, False),  # deepseek-v3, reduced T
    (128, 4096, 14336, 8, 2, "random", "swiglu", None, False),  # mixtral-8x7b, reduced T
]


@pytest.mark.parametrize("case", EXPERT_CASES, ids=lambda c: f"T{c[0]}H{c[1]}I{c[2]}E{c[3]}k{c[4]}-{c[5]}-{c[6]}")
def test_experts_vs_reference(lib, case):
    from mok_nn import cuda_backend as cb
    from mok_nn import reference as ref

    T, H, I, E, k, mode, act, limit, bias = case
    torch.manual_seed(T * 7 + H)
    ids, w = _routing(T, k, E, mode, seed=T + E)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    W13 = (torch.randn(E, 2 * I, H, device="cuda") / H**0.5).to(torch.bfloat16)
    W2 = (torch.randn(E, H, I, device="cuda") / I**0.5).to(torch.bfloat16)
    b13 = (0.1 * torch.randn(E, 2 * I, device="cuda")).to(torch.bfloat16) if bias else None
    b2 = (0.1 * torch.randn(E, H, device="cuda")).to(torch.bfloat16) if bias else None
    dy = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    args = (W13, W2, b13, b2, act, limit)

    results = []
    for _ in range(2):
        y, saved = cb.experts_forward(x, ids, w, *args)
        dx, dw, grads = cb.experts_backward(dy, saved, x, ids, w, *args)
        torch.cuda.synchronize()
        results.append([y, dx, dw, grads.gate_up_proj, grads.down_proj, grads.gate_up_bias, grads.down_bias])
    names = ["y", "dx", "d_topk", "d_gate_up_proj", "d_down_proj", "d_gate_up_bias", "d_down_bias"]
    for n, a, b in zip(names, results[0], results[1]):
        if a is not None:
            assert torch.equal(a, b), f"{n} not bitwise reproducible"

    y_r, saved_r = ref.experts_forward(x, ids, w, *args)
    dx_r, dw_r, g_r = ref.experts_backward(dy, saved_r, ids, w, *args)
    refs = [y_r, dx_r, dw_r, g_r.gate_up_proj, g_r.down_proj, g_r.gate_up_bias, g_r.down_bias]
    for n, got, want in zip(names, results[0], refs):
        if want is None:
            continue
        assert not torch.isnan(got).any(), n
        if want.norm() == 0:
            assert torch.all(got == 0), n
            continue
        err = rel_l2(got, want)
        print(f"{case} {n}: rel L2 {err:.2e}")
        assert err < BF16_TOL, (n, err)
