"""CuTe DSL kernels and the CUDA experts path against fp64/fp32 oracles (needs an sm_90 GPU).

MOK_KERNEL_DIR names a prebuilt library folder; otherwise the loader's search applies.
Outputs are poisoned (NaN) before each run; each result is checked twice for
bitwise equality.
"""

import os

import pytest
import torch

from mok_nn.kernels import registry

from layer_runs import rel_err as rel_l2, slot_products

cuda_ok = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
pytestmark = pytest.mark.skipif(not cuda_ok, reason="needs an sm_90 CUDA GPU")

BF16_TOL = 1e-2  # relative L2 error allowed for bf16 operands / outputs


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
    (3000, 2, 6, 2048, 128, "skew"),  # 4-8 row tiles per expert, 8 column tiles: bands span several waves
]


# (registry name, B read transposed (dgrad), output dtype)
GEMM_VARIANTS = [
    ("mok_gemm_bk", False, torch.bfloat16),
    ("mok_gemm_bk_ef", False, torch.bfloat16),
    ("mok_gemm_bn", True, torch.bfloat16),
    ("mok_gemm_bn_ef", True, torch.bfloat16),
    ("mok_gemm_bn_f32", True, torch.float32),
    ("mok_gemm_bk_pp", False, torch.bfloat16),
    ("mok_gemm_bn_pp", True, torch.bfloat16),
    ("mok_gemm_bk_ppc", False, torch.bfloat16),
    ("mok_gemm_bn_ppc", True, torch.bfloat16),
    ("mok_gemm_bk_n128", False, torch.bfloat16),  # diagnostic narrow tiles (bench_gemm_variants)
    ("mok_gemm_bk_n64", False, torch.bfloat16),
]
# variants whose bits must equal the default's (same K order per output element)
DEFAULT_GEMM = {"mok_gemm_bk_ef": "mok_gemm_bk", "mok_gemm_bn_ef": "mok_gemm_bn",
                "mok_gemm_bk_pp": "mok_gemm_bk", "mok_gemm_bn_pp": "mok_gemm_bn",
                "mok_gemm_bk_ppc": "mok_gemm_bk", "mok_gemm_bn_ppc": "mok_gemm_bn",
                "mok_gemm_bk_n128": "mok_gemm_bk", "mok_gemm_bk_n64": "mok_gemm_bk"}


def test_gemm_variants_listed():
    assert {v[0] for v in GEMM_VARIANTS} == set(registry.GEMM_KERNELS)


def _run_gemm(lib, name, a, W, transpose_w, out_dtype, sched, group_m, real_rows=False):
    """One launch into a NaN-poisoned output, with the seg_rows the callers pass: the padded sizes, or with
    real_rows the routed rows (what Schedule.seg_rows_for gives the ping-pong kernels: half tiles)."""
    out = torch.full((a.shape[0], W.shape[2] if transpose_w else W.shape[1]), float("nan"), device="cuda",
                     dtype=out_dtype)
    b = W.permute(2, 1, 0) if transpose_w else W.permute(1, 2, 0)
    seg_rows = sched.seg_rows if real_rows else sched.gemm_seg_rows()
    lib.launch(name, a.unsqueeze(-1), b, out.unsqueeze(-1), sched.tile_expert, sched.seg_end, seg_rows,
               group_m, stream=torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    return out


@pytest.mark.parametrize("name,transpose_w,out_dtype", GEMM_VARIANTS, ids=[v[0] for v in GEMM_VARIANTS])
@pytest.mark.parametrize("case", GEMM_CASES)
@pytest.mark.parametrize("group_m", [1, 3, 0])  # 0: one raster band per expert (MOK_GEMM_RASTER=expert)
def test_grouped_gemm(lib, case, name, transpose_w, out_dtype, group_m):
    from mok_nn import cuda_backend as cb

    T, k, E, N, K, mode = case
    ids, w = _routing(T, k, E, mode, seed=T + N)
    sched = cb.make_schedule(ids, E)
    x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
    a = cb.gather_rows(x, sched)
    wshape = (E, K, N) if transpose_w else (E, N, K)
    W = torch.randn(wshape, device="cuda", dtype=torch.bfloat16) / K**0.5
    pos = sched.pos.reshape(-1)
    outs = [_run_gemm(lib, name, a, W, transpose_w, out_dtype, sched, group_m) for _ in range(2)]
    assert torch.equal(outs[0][pos], outs[1][pos]), "not bitwise reproducible"
    used = int(sched.seg_end[-1])
    if name in DEFAULT_GEMM:
        ref_bits = _run_gemm(lib, DEFAULT_GEMM[name], a, W, transpose_w, out_dtype, sched, group_m)
        assert torch.equal(outs[0][:used], ref_bits[:used]), f"{name} differs from the default"
    if group_m != 1:  # the tile order changes which CTA computes a tile, never its bits
        col_fastest = _run_gemm(lib, name, a, W, transpose_w, out_dtype, sched, 1)
        assert torch.equal(outs[0][:used], col_fastest[:used]), f"group_m={group_m} differs from group_m=1"
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


EDGE_COUNTS = [1, 63, 0, 64, 65, 127, 128, 129, 200]  # rows per expert around the 64-row halves of a tile


def _edge_routing(g):
    """Top-1 ids giving expert e exactly EDGE_COUNTS[e] rows, in a random token order."""
    counts = torch.tensor(EDGE_COUNTS, device="cuda")
    flat = torch.repeat_interleave(torch.arange(len(EDGE_COUNTS), device="cuda"), counts)
    return flat[torch.randperm(flat.numel(), device="cuda", generator=g)].view(-1, 1)


TAIL_RUNS = [(v, False) for v in GEMM_VARIANTS] + [(v, True) for v in GEMM_VARIANTS if "_pp" in v[0]]


@pytest.mark.parametrize("variant,real_rows", TAIL_RUNS,
                         ids=[v[0] + ("-half_tiles" if r else "") for v, r in TAIL_RUNS])
def test_grouped_gemm_tail_rows(lib, variant, real_rows):
    """Experts whose last tile is 1, 63, 64, 65, 127, 128 or 1 (129) rows full: padding rows
    store exact zeros, real rows match fp64, bits equal the default. real_rows: the ping-pong kernels
    given the routed rows as seg_rows, so the tiles with at most 64 rows run one 64-row MMA block."""
    from mok_nn import cuda_backend as cb

    name, transpose_w, out_dtype = variant

    E, N, K = len(EDGE_COUNTS), 512, 320
    g = torch.Generator(device="cuda").manual_seed(11)
    ids = _edge_routing(g)
    T = ids.shape[0]
    sched = cb.make_schedule(ids, E)
    assert sched.seg_rows.tolist() == EDGE_COUNTS
    x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16, generator=g)
    a = cb.gather_rows(x, sched)
    W = (torch.randn((E, K, N) if transpose_w else (E, N, K), device="cuda", generator=g) / K**0.5).to(torch.bfloat16)
    outs = [_run_gemm(lib, name, a, W, transpose_w, out_dtype, sched, 1, real_rows) for _ in range(2)]
    used = int(sched.seg_end[-1])
    assert torch.equal(outs[0][:used], outs[1][:used]), "not bitwise reproducible"
    pos = sched.pos.reshape(-1)
    ref = slot_products(x, ids, W, transpose_w)
    assert not torch.isnan(outs[0][:used]).any(), "rows left unwritten"
    assert rel_l2(outs[0][pos], ref) < BF16_TOL
    pad = torch.ones(used, dtype=torch.bool, device="cuda")
    pad[pos] = False
    assert torch.all(outs[0][:used][pad] == 0), "padding rows not zero"
    if name in DEFAULT_GEMM:
        ref_bits = _run_gemm(lib, DEFAULT_GEMM[name], a, W, transpose_w, out_dtype, sched, 1)
        assert torch.equal(_bits(outs[0][:used]), _bits(ref_bits[:used])), f"{name} differs from the default"


DYN_VARIANTS = [  # the kernels with dynamic tiles and their static twins
    ("mok_gemm_bk_ef_dyn", "mok_gemm_bk_ef", False, torch.bfloat16),
    ("mok_gemm_bn_ef_dyn", "mok_gemm_bn_ef", True, torch.bfloat16),
    ("mok_gemm_bn_f32_dyn", "mok_gemm_bn_f32", True, torch.float32),
]
EDGE_CASE = "edge"  # the experts of EDGE_COUNTS (last tiles 1, 63, 64, 65, ... rows full)


def test_dyn_variants_listed():
    assert {v[0] for v in DYN_VARIANTS} == set(registry.GEMM_DYN_KERNELS)


@pytest.mark.parametrize("name,twin,transpose_w,out_dtype", DYN_VARIANTS, ids=[v[0] for v in DYN_VARIANTS])
@pytest.mark.parametrize("case", GEMM_CASES + [EDGE_CASE])
@pytest.mark.parametrize("group_m", [1, 0])
def test_grouped_gemm_dyn(lib, case, name, twin, transpose_w, out_dtype, group_m):
    """The _dyn kernels (tiles claimed by atomic add, all-padding warp groups skip their MMA given the routed
    seg_rows): into a NaN-poisoned output, every used row's raw bits equal the static twin's (padded seg_rows),
    the same again on a repeat, real rows within bf16 rounding of fp64, padding rows +0, and the counter shows
    every CTA claimed until it ran dry (tiles + grid claims)."""
    from mok_nn import cuda_backend as cb

    if case == EDGE_CASE:
        E, N, K = len(EDGE_COUNTS), 512, 320
        ids = _edge_routing(torch.Generator(device="cuda").manual_seed(12))
        T, k = ids.shape
    else:
        T, k, E, N, K, mode = case
        ids, _ = _routing(T, k, E, mode, seed=T + N + 1)
    sched = cb.make_schedule(ids, E)
    x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
    a = cb.gather_rows(x, sched)
    W = (torch.randn((E, K, N) if transpose_w else (E, N, K), device="cuda") / K**0.5).to(torch.bfloat16)
    b = W.permute(2, 1, 0) if transpose_w else W.permute(1, 2, 0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count

    def run():
        out = torch.full((a.shape[0], N), float("nan"), device="cuda", dtype=out_dtype)
        counter = torch.zeros(1, dtype=torch.int32, device="cuda")
        lib.launch(name, a.unsqueeze(-1), b, out.unsqueeze(-1), sched.tile_expert, sched.seg_end, sched.seg_rows,
                   group_m, counter, stream=torch.cuda.current_stream().cuda_stream)
        torch.cuda.synchronize()
        return out, int(counter[0])

    (got, claims), (again, _) = run(), run()
    tiles = (a.shape[0] // 128) * ((N + 255) // 256)
    assert claims == tiles + min(tiles, sms), (claims, tiles)
    used = int(sched.seg_end[-1])
    want = _run_gemm(lib, twin, a, W, transpose_w, out_dtype, sched, group_m)
    assert torch.equal(_bits(got[:used]), _bits(again[:used])), "not bitwise reproducible"
    assert torch.equal(_bits(got[:used]), _bits(want[:used])), f"{name} differs from {twin}"
    pos = sched.pos.reshape(-1)
    assert not torch.isnan(got[:used]).any(), "rows left unwritten"
    assert rel_l2(got[pos], slot_products(x, ids, W, transpose_w)) < BF16_TOL
    pad = torch.ones(used, dtype=torch.bool, device="cuda")
    pad[pos] = False
    assert torch.all(_bits(got[:used][pad]) == 0), "padding rows not +0"


@pytest.mark.parametrize("epi", ["split", "full"])
def test_grouped_gemm_backend_epi(lib, epi, monkeypatch):
    """cuda_backend.grouped_gemm under MOK_GEMM_EPI gives the default kernel's bits."""
    from mok_nn import cuda_backend as cb

    ids, _ = _routing(700, 4, 16, "random", seed=5)
    sched = cb.make_schedule(ids, 16)
    a = cb.gather_rows(torch.randn(700, 384, device="cuda", dtype=torch.bfloat16), sched)
    W = (torch.randn(16, 768, 384, device="cuda") / 20).to(torch.bfloat16)
    monkeypatch.setenv("MOK_GEMM_EPI", epi)
    Wt = W.transpose(1, 2).contiguous()
    got = cb.grouped_gemm(a, W, sched, transpose_w=False)
    got_t = cb.grouped_gemm(a, Wt, sched, transpose_w=True)
    want = _run_gemm(lib, "mok_gemm_bk", a, W, False, torch.bfloat16, sched, 1)
    want_t = _run_gemm(lib, "mok_gemm_bn", a, Wt, True, torch.bfloat16, sched, 1)
    used = int(sched.seg_end[-1])
    assert torch.equal(got[:used], want[:used]) and torch.equal(got_t[:used], want_t[:used])


PUSH_CASES = [  # tokens, k, E, N (output columns), K, routing
    (300, 2, 8, 256, 128, "random"),
    (257, 4, 16, 384, 192, "skew"),  # a last column tile past N, empty experts
    (1, 1, 4, 512, 256, "random"),
    (2048, 8, 32, 2048, 768, "random"),  # qwen3-like down GEMM
]


@pytest.mark.parametrize("case", PUSH_CASES, ids=lambda c: f"T{c[0]}k{c[1]}E{c[2]}N{c[3]}K{c[4]}-{c[5]}")
@pytest.mark.parametrize("transpose_w", [False, True])  # mok_gemm_bk_ef_push / mok_gemm_bn_ef_push
def test_grouped_gemm_push(lib, case, transpose_w):
    """mok_gemm_b{k,n}_ef_push (cb.grouped_gemm_push): row r of the GEMM lands in row slot[r] of destination
    rank[r] (two destination tensors standing in for two ranks' sections, poisoned with NaN; padding rows sent
    nowhere): bitwise grouped_gemm's rows, every other destination row untouched, the same on a repeat."""
    from mok_nn import cuda_backend as cb

    T, k, E, N, K, mode = case
    ids, _ = _routing(T, k, E, mode, seed=T + N)
    sched = cb.make_schedule(ids, E)
    a = cb.gather_rows(torch.randn(T, K, device="cuda", dtype=torch.bfloat16), sched)
    W = (torch.randn(E, N, K, device="cuda") / K**0.5).to(torch.bfloat16)
    if transpose_w:
        W = W.transpose(1, 2).contiguous()  # [E, K, N], read N-major
    want = cb.grouped_gemm(a, W, sched, transpose_w=transpose_w)
    M = sched.capacity
    g = torch.Generator(device="cuda").manual_seed(T)
    real = sched.row_token < T
    rank = torch.where(real, torch.randint(0, 2, (M,), device="cuda", generator=g), -1)
    slot = torch.randperm(M, device="cuda", generator=g)  # distinct destination rows
    outs = []
    for _ in range(2):
        secs = [torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16) for _ in range(2)]
        base = torch.tensor([t.data_ptr() for t in secs], dtype=torch.int64, device="cuda")
        cb.grouped_gemm_push(a, W, sched, base, rank, slot, transpose_w=transpose_w)
        torch.cuda.synchronize()
        outs.append(secs)
    for p in range(2):
        sel = rank == p
        assert torch.equal(outs[0][p][slot[sel]], want[sel]), f"rank {p}: rows differ from grouped_gemm"
        untouched = torch.ones(M, dtype=torch.bool, device="cuda")
        untouched[slot[sel]] = False
        assert torch.isnan(outs[0][p][untouched]).all(), f"rank {p}: rows written that were not sent there"
        assert torch.equal(outs[0][p].view(torch.int16), outs[1][p].view(torch.int16)), "not reproducible"
    assert int(real.sum()) == T * k


WGRAD_CASES = [  # tokens, k, E, Na, Nb, routing
    (256, 2, 8, 512, 256, "random"),
    (1, 1, 4, 256, 128, "random"),
    (333, 2, 8, 200, 1000, "skew"),  # Na, Nb not multiples of the tile; experts without rows
    (300, 1, 3, 136, 72, "one_expert"),  # one expert over several K tiles, two empty ones
    (700, 4, 16, 384, 8448, "random"),  # Nb spans > 32 column tiles: banded raster
    (400, 2, 8, 384, 512, "random"),  # 3 row tiles: the clustered kernels' last pair has a row past M
]


@pytest.mark.parametrize("kernel", registry.WGRAD_KERNELS)
@pytest.mark.parametrize("case", WGRAD_CASES)
def test_weight_grad_gemm(lib, case, kernel, monkeypatch):
    """mok_gemm_wgrad: per expert, A rows^T @ B rows over that expert's rows only."""
    from mok_nn import cuda_backend as cb

    T, k, E, Na, Nb, mode = case
    ids, _ = _routing(T, k, E, mode, seed=3 * T + Na)
    sched = cb.make_schedule(ids, E)
    a = cb.gather_rows(torch.randn(T, Na, device="cuda", dtype=torch.bfloat16), sched)
    b = cb.gather_rows(torch.randn(T, Nb, device="cuda", dtype=torch.bfloat16), sched)
    counts = cb.expert_row_counts(ids, E)
    assert torch.equal(counts.long(), torch.bincount(ids.reshape(-1), minlength=E))
    outs = []
    for _ in range(2):
        out = torch.full((E, Na, Nb), float("nan"), device="cuda", dtype=torch.bfloat16)
        cb._lib().launch(kernel, a.t().unsqueeze(-1), b.t().unsqueeze(-1), out.permute(1, 2, 0),
                         sched.seg_end, counts, cb.wgrad_group_m(kernel, Nb),
                         stream=torch.cuda.current_stream().cuda_stream)
        torch.cuda.synchronize()
        outs.append(out)
    assert torch.equal(outs[0], outs[1]), "not bitwise reproducible"
    got = outs[0]
    assert not torch.isnan(got).any(), "outputs left unwritten"
    # oracle: per expert, its routed rows only (fp64), from the slot order, not the schedule
    pos = sched.pos.reshape(-1)
    flat = ids.reshape(-1)
    for e in range(E):
        rows = pos[flat == e]
        want = a[rows].double().t() @ b[rows].double()
        if rows.numel() == 0:
            assert torch.all(got[e] == 0), f"expert {e} without rows: nonzero gradient"
            continue
        err = rel_l2(got[e], want)
        assert err < BF16_TOL, (e, err)
    # the public helper returns the same bits
    monkeypatch.setenv("MOK_WGRAD_KERNEL", kernel)
    assert torch.equal(cb.weight_grad(a, b, sched, counts), got)


VARIANT_CASES = [  # rows per expert (top-1 routing, tokens shuffled), Na, Nb
    ((0, 1, 64, 65, 0, 128, 129, 3), 200, 392),  # K tile edges, empty experts, partial M and N tiles
    # ~4 output tiles per CTA, short K: epilogue buffers reused across tiles; every 16-row
    # position of an expert's last row in its K tile
    ((1, 64, 65, 0, 17, 130, 33, 48, 100, 7, 2, 64, 111, 0, 16, 81), 1024, 1536),
]


def _variant_problem(case, seed_base):
    """(ids, schedule, counts, A rows, B rows, generator) of a VARIANT_CASES case: top-1 routing with the
    case's rows per expert, tokens shuffled, random bf16 rows in schedule order."""
    from mok_nn import cuda_backend as cb

    rows_per_expert, Na, Nb = case
    E = len(rows_per_expert)
    g = torch.Generator(device="cuda").manual_seed(E * Na + Nb + seed_base * 7919)
    ids = torch.repeat_interleave(torch.arange(E, device="cuda"), torch.tensor(rows_per_expert, device="cuda"))
    ids = ids[torch.randperm(ids.numel(), device="cuda", generator=g)].unsqueeze(1)
    T = ids.shape[0]
    sched = cb.make_schedule(ids, E)
    counts = cb.expert_row_counts(ids, E)
    a = cb.gather_rows(torch.randn(T, Na, device="cuda", dtype=torch.bfloat16, generator=g), sched)
    b = cb.gather_rows(torch.randn(T, Nb, device="cuda", dtype=torch.bfloat16, generator=g), sched)
    return ids, sched, counts, a, b, g


@pytest.mark.parametrize("kernel", [k for k in registry.WGRAD_KERNELS if k != "mok_gemm_wgrad"])
@pytest.mark.parametrize("case", VARIANT_CASES, ids=["edges", "many_tiles"])
def test_weight_grad_variant_equals_default(lib, case, kernel):
    """Every wgrad variant keeps the K order and the one bf16 rounding: bitwise equal to mok_gemm_wgrad."""
    from mok_nn import cuda_backend as cb

    ids, sched, counts, a, b, _ = _variant_problem(case, seed_base=0)
    E, Na, Nb = len(case[0]), case[1], case[2]
    outs = {}
    for name in ("mok_gemm_wgrad", kernel, kernel):
        out = torch.full((E, Na, Nb), float("nan"), device="cuda", dtype=torch.bfloat16)
        cb._lib().launch(name, a.t().unsqueeze(-1), b.t().unsqueeze(-1), out.permute(1, 2, 0),
                         sched.seg_end, counts, cb.wgrad_group_m(name, Nb),
                         stream=torch.cuda.current_stream().cuda_stream)
        torch.cuda.synchronize()
        assert not torch.isnan(out).any(), f"{name}: outputs left unwritten"
        if name in outs:
            assert torch.equal(out, outs[name]), f"{name} not bitwise reproducible"
        outs[name] = out
    assert torch.equal(outs[kernel], outs["mok_gemm_wgrad"]), "differs from mok_gemm_wgrad"
    pos = sched.pos.reshape(-1)
    for e in range(E):
        rows = pos[ids.reshape(-1) == e]
        if rows.numel() == 0:
            assert torch.all(outs[kernel][e] == 0), e
            continue
        want = a[rows].double().t() @ b[rows].double()
        assert rel_l2(outs[kernel][e], want) < BF16_TOL, e


@pytest.mark.parametrize("case", VARIANT_CASES, ids=["edges", "many_tiles"])
def test_weight_grad_accumulates(lib, case, monkeypatch):
    """weight_grad(into=): the accumulating kernel adds the bf16 result into `into` in its stores; every
    element is bf16(into + the plain kernel's result), the add of two bf16 values rounded once."""
    from mok_nn import cuda_backend as cb

    _, sched, counts, a, b, g = _variant_problem(case, seed_base=1)
    E, Na, Nb = len(case[0]), case[1], case[2]
    monkeypatch.delenv("MOK_WGRAD_KERNEL", raising=False)
    monkeypatch.delenv("MOK_WGRAD", raising=False)
    plain = cb.weight_grad(a, b, sched, counts)
    before = torch.randn(E, Na, Nb, device="cuda", generator=g).to(torch.bfloat16) * 8
    want = (before.float() + plain.float()).to(torch.bfloat16)  # exact in fp32, then one rounding
    outs = []
    for _ in range(2):
        into = before.clone()
        got = cb.weight_grad(a, b, sched, counts, into=into)
        torch.cuda.synchronize()
        assert got is into, "weight_grad(into=) must return the tensor it added into"
        outs.append(into)
    assert torch.equal(outs[0], outs[1]), "not bitwise reproducible"
    assert torch.equal(outs[0], want), f"{(outs[0] != want).sum().item()} elements differ from bf16(into + result)"
    # a variant without an accumulating twin adds the same way outside the kernel
    monkeypatch.setenv("MOK_WGRAD_KERNEL", "mok_gemm_wgrad")
    assert "mok_gemm_wgrad" not in registry.WGRAD_ACC_KERNELS
    assert torch.equal(cb.weight_grad(a, b, sched, counts, into=before.clone()), want)


def _combine_problem(T, k, H, E, seed):
    """rows [T*k + 5, H] bf16, pos [T, k] (distinct rows), w [T, k] fp32, ids [T, k] (distinct experts per token)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    R = T * k + 5
    rows = torch.randn(R, H, device="cuda", dtype=torch.bfloat16, generator=g)
    pos = torch.randperm(R, device="cuda", generator=g)[: T * k].view(T, k)
    w = torch.rand(T, k, device="cuda", generator=g)
    ids = torch.rand(T, E, device="cuda", generator=g).argsort(dim=1)[:, :k].contiguous()
    return rows, pos, w, ids


@pytest.mark.parametrize("T,k,H,E", [(1, 1, 8, 8), (513, 8, 2048, 128), (64, 2, 7168, 8), (100, 4, 256, 6),
                                     (5, 32, 72, 64)])  # top_k = 32: every lane holds a slot
def test_combine(lib, T, k, H, E):
    from mok_nn import cuda_backend as cb

    rows, pos, w, ids = _combine_problem(T, k, H, E, seed=T + E)
    ys = [cb.combine(rows, pos, w, ids, E, torch.bfloat16) for _ in range(2)]
    assert torch.equal(ys[0], ys[1])
    ref = (rows.double()[pos] * w.double()[..., None]).sum(1)
    assert rel_l2(ys[0], ref) < 5e-3  # one bf16 rounding of the fp32 sum
    # the torch stand-in of the same tree (w * row rounded before the add, the kernel fuses them)
    assert rel_l2(ys[0], cb.combine_torch(rows, pos, w, ids, E, torch.float32)) < 5e-3


@pytest.mark.parametrize("k", [1, 2, 3, 8, 16])
def test_combine_kernels_same_bits(lib, k):
    """The three combine loops (mok_combine: one column chunk at a time; mok_combine_k2: top_k = 2 only;
    mok_combine_cp: loads staged by cp.async, top_k <= 16) add the same terms in the same order: the same
    bits, for token counts below and above a thread's chunk batch, several batches per token (H past
    128 * 16 / k * 8 columns), and slots left out (pos -1). Outputs NaN-poisoned first."""
    from mok_nn import cuda_backend as cb

    g = torch.Generator(device="cuda").manual_seed(100 + k)
    names = ["mok_combine", "mok_combine_cp"] + (["mok_combine_k2"] if k == 2 else [])
    for T, H in [(1, 8), (5, 1032), (397, 7168), (2000, 2048)]:
        E = 32
        R = T * k + 3
        rows = torch.randn(R, H, device="cuda", generator=g).to(torch.bfloat16)
        pos = torch.randperm(R, device="cuda", generator=g)[: T * k].view(T, k).contiguous()
        pos[torch.rand(T, k, device="cuda", generator=g) < 0.1] = -1
        w = torch.rand(T, k, device="cuda", generator=g)
        ids = torch.rand(T, E, device="cuda", generator=g).argsort(dim=1)[:, :k].contiguous()
        outs = []
        for name in names:
            out = torch.full((T, H), float("nan"), device="cuda", dtype=torch.bfloat16)
            cb._lib().launch(name, rows, pos, w, ids, out, cb.experts_per_leaf(E), stream=cb._stream())
            outs.append(out)
        ref = (rows.double()[pos.clamp(min=0)] * (w.double() * (pos >= 0))[..., None]).sum(1)
        assert rel_l2(outs[0], ref) < 5e-3, (T, H)
        for name, out in zip(names[1:], outs[1:]):
            assert torch.equal(out.view(torch.int16), outs[0].view(torch.int16)), (name, T, H)


@pytest.mark.parametrize("weighted", [1, 0])
def test_partial_push_many_sources(lib, weighted):
    """The EP form with P sources at once: sources with fewer tokens than Tc (ids -1 past them), one
    slot cut by the capacity (slot_row >= the rows: skipped, as a zero weight would add nothing), each
    virtual rank's nodes stored per source (part_base[s]) at rows rank * Tc + t; every source's
    final sum is bitwise mok_combine over its own slots."""
    from mok_nn import cuda_backend as cb

    P, tc, k, H, E = 2, 96, 8, 264, 64
    counts = [96, 41]
    g = torch.Generator(device="cuda").manual_seed(5)
    ids_all = torch.rand(P, tc, E, device="cuda", generator=g).argsort(dim=2)[:, :, :k].contiguous()
    for s_, n in enumerate(counts):
        ids_all[s_, n:] = -1
    rows = torch.randn(P * tc * k, H, device="cuda", dtype=torch.bfloat16, generator=g)
    slot_row = torch.arange(P * tc * k, device="cuda")  # slot (s, t, j) -> its own row
    cut = 5 * k + 2  # source 0, token 5, j = 2: past the capacity
    slot_row[cut] = rows.shape[0]
    w_all = torch.rand(P * tc * k + 1, device="cuda", generator=g)
    parts = [torch.full((P, tc, H), float("nan"), device="cuda") for _ in range(P)]
    base = torch.tensor([p.data_ptr() for p in parts], dtype=torch.int64, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream
    for q in range(P):  # virtual expert rank q holds experts [q E/P, (q + 1) E/P)
        cb._lib().launch("mok_ep_partial_push", rows, slot_row, w_all, ids_all, base, q, E // P,
                         cb.experts_per_leaf(E), weighted, q * tc, stream=stream)
    flags = torch.zeros(4, dtype=torch.int32, device="cuda")
    for s_, n in enumerate(counts):
        ids = ids_all[s_, :n].contiguous()
        out = torch.full((n, H), float("nan"), device="cuda", dtype=torch.bfloat16)
        cb._lib().launch("mok_combine_final", parts[s_], ids, flags, out, E // P, cb.experts_per_leaf(E),
                         stream=stream)
        pos = (s_ * tc + torch.arange(n, device="cuda")).unsqueeze(1) * k + torch.arange(k, device="cuda")
        w = w_all[pos] if weighted else torch.ones(n, k, device="cuda")
        w = torch.where(pos == cut, 0.0, w)
        want = cb.combine(rows, pos, w, ids, E, torch.bfloat16)
        torch.cuda.synchronize()
        assert not torch.isnan(out).any(), s_
        assert torch.equal(out, want), s_


def test_top_k_above_32_is_refused(lib):
    from mok_nn import cuda_backend as cb

    x = torch.randn(4, 64, device="cuda", dtype=torch.bfloat16)
    gu = torch.randn(64, 64, 64, device="cuda", dtype=torch.bfloat16)
    dn = torch.randn(64, 64, 32, device="cuda", dtype=torch.bfloat16)
    ids = torch.zeros(4, 33, dtype=torch.int64, device="cuda")
    assert "at most 32" in cb.check_supported(x, ids, gu, dn, "swiglu")
    assert cb.check_supported(x, ids[:, :32], gu, dn, "swiglu") is None


def test_combine_tree_order(lib):
    """The kernel adds in the tree over expert groups, not in slot order: by leaf 2^27, -2^27, 1, 1
    gives (2^27 - 2^27) + (1 + 1) = 2, where the slot order (leaves 3, 0, 2, 1) gives
    ((1 + 2^27) + 1) - 2^27 = 0 in fp32. The EP pre-reduced path gives the same 2."""
    from mok_nn import cuda_backend as cb

    by_leaf = [2.0**27, -(2.0**27), 1.0, 1.0]
    ids = torch.tensor([[3, 0, 2, 1]], device="cuda")
    rows = torch.tensor([[by_leaf[e]] * 8 for e in (3, 0, 2, 1)], device="cuda", dtype=torch.bfloat16)
    pos = torch.arange(4, device="cuda").view(1, 4)
    w = torch.ones(1, 4, device="cuda")
    y = cb.combine(rows, pos, w, ids, 8, torch.bfloat16)
    assert y.float().tolist() == [[2.0] * 8]
    assert _partial_final(rows, pos, w, ids, 8, 2, weighted=1).float().tolist() == [[2.0] * 8]


def _partial_final(rows, pos, w, ids, E, P, weighted, flags=None, staged=False):
    """The EP combine's two halves on one GPU: P virtual expert ranks each push their node of every
    token (one source) into parts[q] (NaN-poisoned first), then the tree over the P nodes.
    staged: each rank writes its nodes to a staging block at row 0 (dst_row0 = 0), copied to parts[q]
    afterwards (the copy-engine form of the backward's d x)."""
    from mok_nn import cuda_backend as cb

    T, k = ids.shape
    H = rows.shape[1]
    stream = torch.cuda.current_stream().cuda_stream
    parts = torch.full((P, T, H), float("nan"), device="cuda")
    for q in range(P):
        dst = torch.full((T, H), float("nan"), device="cuda") if staged else parts
        base = torch.tensor([dst.data_ptr()], dtype=torch.int64, device="cuda")
        cb._lib().launch("mok_ep_partial_push", rows, pos.reshape(-1), w.reshape(-1).contiguous(), ids.view(1, T, k),
                         base, q, E // P, cb.experts_per_leaf(E), weighted, 0 if staged else q * T, stream=stream)
        if staged:
            parts[q].copy_(dst)
    out = torch.full((T, H), float("nan"), device="cuda", dtype=torch.bfloat16)
    flags = torch.zeros(4, dtype=torch.int32, device="cuda") if flags is None else flags
    cb._lib().launch("mok_combine_final", parts, ids, flags, out, E // P, cb.experts_per_leaf(E), stream=stream)
    torch.cuda.synchronize()
    return out


@pytest.mark.parametrize("P", [2, 4, 8])
@pytest.mark.parametrize("weighted", [1, 0])
@pytest.mark.parametrize("T,k,H,E", [(300, 8, 512, 64), (77, 2, 7168, 8), (1, 1, 8, 8), (40, 32, 136, 64)])
def test_partial_push_final_equals_combine(lib, T, k, H, E, P, weighted):
    """Pre-reduced per rank (mok_ep_partial_push on each of P ranks, mok_combine_final on the source)
    is bitwise the single-GPU combine, for every P dividing the 8 leaves: the EP combine's bits do
    not depend on the EP degree. Tokens without a slot on a rank leave its (NaN) row unread."""
    from mok_nn import cuda_backend as cb

    rows, pos, w, ids = _combine_problem(T, k, H, E, seed=7 * T + P)
    w_used = w if weighted else torch.ones_like(w)
    want = cb.combine(rows, pos, w_used, ids, E, torch.bfloat16)
    got = _partial_final(rows, pos, w, ids, E, P, weighted)
    assert not torch.isnan(got).any()
    assert torch.equal(got, want)
    assert torch.equal(_partial_final(rows, pos, w, ids, E, P, weighted, staged=True), want)
    assert torch.equal(_partial_final(rows, pos, w, ids, E, P, weighted), got)  # repeat: same bits
    bad = torch.tensor([0, 0, 3, 0], dtype=torch.int32, device="cuda")  # an error flag: NaN outputs
    assert torch.isnan(_partial_final(rows, pos, w, ids, E, P, weighted, flags=bad)).all()


EXPERT_CASES = [  # T, H, I, E, k, routing, activation, limit, bias
    (256, 256, 128, 8, 2, "random", "swiglu", None, False),
    (1, 256, 128, 8, 2, "random", "swiglu", None, False),
    (300, 512, 256, 16, 4, "skew", "swiglu", 7.0, False),
    (200, 256, 192, 4, 2, "one_expert", "swiglu_oai", 7.0, True),
    (512, 2048, 768, 128, 8, "random", "swiglu", None, False),  # qwen3-30b-a3b, reduced T
    (256, 7168, 2048, 256, 8, "random", "swiglu", None, False),  # deepseek-v3, reduced T
    (128, 4096, 14336, 8, 2, "random", "swiglu", None, False),  # mixtral-8x7b, reduced T
    (300, 256, 512, 8, 2, "skew", "swiglu_oai", 7.0, True),  # biases, I % 256 == 0 (the fused dSwiGLU can run)
]


@pytest.mark.parametrize("case", EXPERT_CASES, ids=lambda c: f"T{c[0]}H{c[1]}I{c[2]}E{c[3]}k{c[4]}-{c[5]}-{c[6]}")
# MOK_GEMM_DACT (fused runs where I % 256 == 0); pingpong: the ping-pong GEMMs with both fused epilogues
@pytest.mark.parametrize("dact", ["split", "fused", "pingpong"])
def test_experts_vs_reference(lib, case, dact, monkeypatch):
    from mok_nn import cuda_backend as cb
    from mok_nn import functional

    monkeypatch.setenv("MOK_GEMM_DACT", "split" if dact == "split" else "fused")
    if dact == "pingpong":
        monkeypatch.setenv("MOK_GEMM_ACT", "fused")
        monkeypatch.setenv("MOK_GEMM_PINGPONG", "1")

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

    # the oracle: the reference backend through the functional layer (its stable interface)
    ws = functional.get_workspace(
        hidden_size=H, intermediate_size=I, num_experts=E, top_k=k, device=x.device, dtype=x.dtype,
        backend="reference", activation=act, swiglu_limit=limit,
    )
    params = functional.ExpertParams(W13, W2, b13, b2)
    y_r, saved_r = functional.forward(x, ids, w, params, functional.build_schedule(ids, ws), ws)
    dx_r, dw_r, g_r = functional.backward(dy, saved_r, x, ids, w, params, ws)
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


@pytest.mark.parametrize("T,k,E,mode", [(1, 1, 4, "random"), (333, 2, 8, "skew"), (300, 1, 3, "one_expert"),
                                        (8192, 8, 128, "random"), (4096, 8, 256, "skew"), (1000, 6, 512, "random")])
def test_schedule_kernel_equals_torch_schedule(lib, T, k, E, mode):
    from mok_nn import cuda_backend as cb

    ids, _ = _routing(T, k, E, mode, seed=T * k + E)
    want = cb.make_schedule_torch(ids, E)
    for _ in range(2):
        got = cb.make_schedule(ids, E)
        torch.cuda.synchronize()
        for name in ("pos", "row_token", "tile_expert", "seg_end", "seg_rows"):
            assert torch.equal(getattr(got, name), getattr(want, name)), name


ACT_CASES = [  # T, k, E, H, I, routing, activation, limit
    (256, 2, 8, 256, 128, "random", "swiglu", None),
    (333, 2, 8, 320, 384, "skew", "swiglu", 7.0),  # three h tiles, empty experts
    (300, 1, 3, 128, 256, "one_expert", "swiglu_oai", 7.0),
    (1, 1, 4, 256, 128, "random", "swiglu_oai", None),
    (512, 8, 128, 2048, 768, "random", "swiglu", None),  # qwen3-30b-a3b, reduced T
    (96, 2, 8, 4096, 14336, "random", "swiglu", None),  # mixtral-8x7b: 56 h tiles (raster bands of 8 rows)
]
# MOK_GEMM_PINGPONG, MOK_GEMM_EPI -> mok_gemm_gate_up_<act>_ef, mok_gemm_gate_up_<act>, _pp, _ppc
ACT_VARIANTS = {"coop_full": ("0", "full"), "coop_split": ("0", "split"), "pp": ("1", "auto"),
                "ppc": ("cluster", "auto"), "coop_full-expert": ("0", "full"), "ppc-expert": ("cluster", "auto")}
# (-expert: MOK_GEMM_RASTER=expert, one raster band per expert; the others MOK_GEMM_RASTER=bands)


@pytest.mark.parametrize("case", ACT_CASES, ids=lambda c: f"T{c[0]}E{c[2]}H{c[3]}I{c[4]}-{c[5]}-{c[6]}-{c[7]}")
@pytest.mark.parametrize("variant", list(ACT_VARIANTS))
def test_gate_up_act_fused(lib, case, variant, monkeypatch):
    """mok_gemm_gate_up_<act>[_ef|_pp|_ppc]: gate_up and h bitwise equal to mok_gemm_bk + mok_act_fwd_<act>."""
    from mok_nn import cuda_backend as cb
    from mok_nn import reference

    T, k, E, H, I, mode, act, limit = case
    ids, _ = _routing(T, k, E, mode, seed=T + I)
    sched = cb.make_schedule(ids, E)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    a = cb.gather_rows(x, sched)
    W13 = (torch.randn(E, 2 * I, H, device="cuda") / H**0.5).to(torch.bfloat16)
    used = int(sched.seg_end[-1])
    gu_ref = cb.grouped_gemm(a, W13, sched, transpose_w=False)
    h_ref = cb.act_forward(gu_ref, sched, act, limit)
    pingpong, epi = ACT_VARIANTS[variant]
    monkeypatch.setenv("MOK_GEMM_PINGPONG", pingpong)
    monkeypatch.setenv("MOK_GEMM_EPI", epi)
    monkeypatch.setenv("MOK_GEMM_RASTER", "expert" if variant.endswith("-expert") else "bands")
    outs = []
    for _ in range(2):
        gu, h = cb.gate_up_act(a, W13, sched, act, limit)
        torch.cuda.synchronize()
        outs.append((gu[:used].clone(), h[:used].clone()))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1]), "not bitwise reproducible"
    gu, h = outs[0]
    assert not torch.isnan(gu).any() and not torch.isnan(h).any()
    # independent check of the real rows in fp64
    pos = sched.pos.reshape(-1)
    gu64 = slot_products(x, ids, W13, False)
    assert rel_l2(gu[pos], gu64) < BF16_TOL
    h64 = reference.activation_forward(gu[pos].double(), act, limit)
    assert rel_l2(h[pos], h64) < BF16_TOL
    assert torch.equal(gu, gu_ref[:used]), "gate_up differs from mok_gemm_bk"
    assert torch.equal(h, h_ref[:used]), "h differs from mok_act_fwd"


def test_gate_up_act_in_forward(lib, monkeypatch):
    """MOK_GEMM_ACT=fused: experts_forward gives the same bits as the two-kernel path."""
    from mok_nn import cuda_backend as cb

    T, H, I, E, k = 300, 256, 256, 8, 2
    ids, w = _routing(T, k, E, "random", seed=9)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    W13 = (torch.randn(E, 2 * I, H, device="cuda") / H**0.5).to(torch.bfloat16)
    W2 = (torch.randn(E, H, I, device="cuda") / I**0.5).to(torch.bfloat16)
    y0, s0 = cb.experts_forward(x, ids, w, W13, W2)
    monkeypatch.setenv("MOK_GEMM_ACT", "fused")
    y1, s1 = cb.experts_forward(x, ids, w, W13, W2)
    used = int(s0.sched.seg_end[-1])
    assert torch.equal(y0, y1) and torch.equal(s0.gate_up[:used], s1.gate_up[:used])


DACT_CASES = [  # T, k, E, H, I, routing, activation, limit
    (256, 2, 8, 256, 256, "random", "swiglu", None),
    (333, 2, 8, 320, 512, "skew", "swiglu", 7.0),  # two column tiles, empty experts, clamps active
    (300, 1, 3, 128, 256, "one_expert", "swiglu_oai", 7.0),
    (1, 1, 4, 256, 256, "random", "swiglu_oai", None),
    (512, 8, 128, 2048, 768, "random", "swiglu", None),  # qwen3-30b-a3b, reduced T: 3 column tiles
    (96, 2, 8, 4096, 14336, "random", "swiglu", None),  # mixtral-8x7b: 56 column tiles (raster bands)
]


@pytest.mark.parametrize("case", DACT_CASES, ids=lambda c: f"T{c[0]}E{c[2]}H{c[3]}I{c[4]}-{c[5]}-{c[6]}-{c[7]}")
@pytest.mark.parametrize("suffix", ["", "_pp", "_ppc", "_pp-half_tiles", "_ppc-half_tiles", "-expert", "_ppc-expert"])
# cooperative, ping-pong, on 2-CTA clusters; half_tiles: given the routed rows as seg_rows (Schedule.seg_rows_for),
# one MMA block where <= 64 rows; expert: group_m 0, one raster band per expert
def test_dgrad_act_fused(lib, case, suffix):
    """mok_gemm_dact_<act>[_pp]: d gate_up and w*h bitwise equal to mok_gemm_bn_f32 + mok_act_bwd_<act>;
    the per-row d topk-weight close to theirs and to an fp64 oracle; all outputs poisoned, run twice."""
    from mok_nn import cuda_backend as cb
    from mok_nn import reference

    T, k, E, H, I, mode, act, limit = case
    ids, w = _routing(T, k, E, mode, seed=T + 3 * I)
    sched = cb.make_schedule(ids, E)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    W13 = (torch.randn(E, 2 * I, H, device="cuda") / H**0.5).to(torch.bfloat16)
    W2 = (torch.randn(E, H, I, device="cuda") / I**0.5).to(torch.bfloat16)
    gate_up = cb.grouped_gemm(cb.gather_rows(x, sched), W13, sched, transpose_w=False)
    dy_rows = cb.gather_rows(dy, sched)
    w_rows = cb.row_weights(sched, w)
    m, used = sched.capacity, int(sched.seg_end[-1])
    suffix, _, tag = suffix.partition("-")
    name = f"mok_gemm_dact_{act}{suffix}"
    seg_rows = sched.seg_rows if tag == "half_tiles" else sched.gemm_seg_rows()
    tile_n = registry.tile_n_of(name)
    group_m = 0 if tag == "expert" else cb.band_rule(I, tile_n)
    tiles_n = I // tile_n
    runs = []
    for _ in range(2):
        dgu = torch.full_like(gate_up, float("nan"))
        wh = torch.full((m, I), float("nan"), device="cuda", dtype=torch.bfloat16)
        parts = torch.full((tiles_n, m), float("nan"), device="cuda")
        lib.launch(
            name, dy_rows.unsqueeze(-1), W2.permute(2, 1, 0), dgu.unsqueeze(-1), wh.unsqueeze(-1),
            gate_up.unsqueeze(-1), w_rows, parts, sched.tile_expert, sched.seg_end, seg_rows,
            float("inf") if limit is None else limit, group_m,
            stream=torch.cuda.current_stream().cuda_stream,
        )  # fmt: skip
        torch.cuda.synchronize()
        runs.append((dgu[:used].clone(), wh[:used].clone(), parts[:, :used].clone()))
    for a, b in zip(runs[0], runs[1]):
        assert torch.equal(a, b), "not bitwise reproducible"
    dgu, wh, parts = runs[0]
    assert not torch.isnan(dgu).any() and not torch.isnan(wh).any() and not torch.isnan(parts).any()
    # the two-kernel path: the same d gate_up and w*h bits, d topk-weight within fp32 reordering
    dh = cb.grouped_gemm(dy_rows, W2, sched, transpose_w=True, out_dtype=torch.float32)
    dgu2, wh2, dw2 = cb.act_backward(gate_up, dh, w_rows, sched, act, limit)
    assert torch.equal(dgu, dgu2[:used]), "d gate_up differs from mok_act_bwd"
    assert torch.equal(wh, wh2[:used]), "w*h differs from mok_act_bwd"
    dw = cb.pairwise_sum(parts)
    assert rel_l2(dw, dw2[:used]) < 1e-5
    # fp64 oracle on the real rows: dh = dy @ W2[e], h from the bf16 gate_up
    pos = sched.pos.reshape(-1)
    dh64 = slot_products(dy, ids, W2, True)
    gu64 = gate_up[pos].double()
    h64 = reference.activation_forward(gu64, act, limit).to(torch.bfloat16).double()
    w64 = w.reshape(-1, 1).double()
    assert rel_l2(cb.pairwise_sum(parts)[pos], (dh64 * h64).sum(dim=1)) < BF16_TOL
    assert rel_l2(wh[pos], w64 * h64) < BF16_TOL
    assert rel_l2(dgu[pos], reference.activation_backward(gu64, w64 * dh64, act, limit)) < BF16_TOL


def test_dgrad_act_in_backward(lib, monkeypatch):
    """MOK_GEMM_DACT=fused vs split through experts_backward: dx and both weight gradients bitwise equal,
    d topk-weights within fp32 reordering."""
    from mok_nn import cuda_backend as cb

    T, H, I, E, k = 300, 256, 512, 8, 2
    ids, w = _routing(T, k, E, "random", seed=11)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    W13 = (torch.randn(E, 2 * I, H, device="cuda") / H**0.5).to(torch.bfloat16)
    W2 = (torch.randn(E, H, I, device="cuda") / I**0.5).to(torch.bfloat16)
    out = {}
    for mode in ("split", "fused"):  # (split is the default)
        monkeypatch.setenv("MOK_GEMM_DACT", mode)
        y, saved = cb.experts_forward(x, ids, w, W13, W2)
        dx, dtk, g = cb.experts_backward(dy, saved, x, ids, w, W13, W2)
        out[mode] = (dx, g.gate_up_proj, g.down_proj, dtk)
    for a, b in zip(out["split"][:3], out["fused"][:3]):
        assert torch.equal(a, b)
    assert rel_l2(out["fused"][3], out["split"][3]) < 1e-5


def _layer_problem(T, H, I, E, k, mode, seed):
    """(ids, w, x, dy, W13, W2) of a layer test: routing, bf16 inputs and weights scaled by 1/sqrt(fan-in)."""
    ids, w = _routing(T, k, E, mode, seed=seed)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    W13 = (torch.randn(E, 2 * I, H, device="cuda") / H**0.5).to(torch.bfloat16)
    W2 = (torch.randn(E, H, I, device="cuda") / I**0.5).to(torch.bfloat16)
    return ids, w, x, dy, W13, W2


@pytest.mark.parametrize("case", [(300, 256, 512, 8, 2, "random"), (512, 2048, 768, 128, 8, "skew")])
@pytest.mark.parametrize("pp_mode", ["1", "cluster"])  # MOK_GEMM_PINGPONG
def test_pingpong_in_layer(lib, case, pp_mode, monkeypatch):
    """MOK_GEMM_PINGPONG=1 / cluster with the fused epilogues (MOK_GEMM_ACT=fused, MOK_GEMM_DACT=fused) against the
    default path through experts_forward / experts_backward: y, dx and both weight gradients bitwise
    equal, d topk-weights within fp32 reordering (summed per 128 instead of 256 columns); run twice."""
    from mok_nn import cuda_backend as cb

    T, H, I, E, k, mode = case
    ids, w, x, dy, W13, W2 = _layer_problem(T, H, I, E, k, mode, seed=T + I)

    def run():
        y, saved = cb.experts_forward(x, ids, w, W13, W2)
        dx, dtk, g = cb.experts_backward(dy, saved, x, ids, w, W13, W2)
        torch.cuda.synchronize()
        return y, dx, g.gate_up_proj, g.down_proj, dtk

    want = run()
    for var in ("MOK_GEMM_PINGPONG", "MOK_GEMM_ACT", "MOK_GEMM_DACT"):
        monkeypatch.setenv(var, pp_mode if var == "MOK_GEMM_PINGPONG" else "fused")
    got, again = run(), run()
    names = ("y", "dx", "d_gate_up_proj", "d_down_proj", "d_topk")
    for n, a, b in zip(names, got, again):
        assert torch.equal(a, b), f"{n} not bitwise reproducible"
    for n, a, b in zip(names[:4], got, want):
        assert torch.equal(a, b), f"{n} differs from the default path"
    assert rel_l2(got[4], want[4]) < 1e-5


def _bits(t):
    """t's raw bits (so that -0.0 and +0.0 differ, which torch.equal does not see)."""
    return t.contiguous().view({2: torch.int16, 4: torch.int32}[t.element_size()])


@pytest.mark.parametrize("case", [(300, 256, 512, 8, 2, "random", False), (512, 2048, 768, 128, 8, "skew", False),
                                  (300, 256, 512, 8, 2, "random", True)])
def test_half_tiles_in_layer(lib, case, monkeypatch):
    """MOK_GEMM_HALF_TILES=1 (default) vs 0 through experts_forward / experts_backward with the ping-pong
    kernels (qwen3's: fused gate/up + SwiGLU, down, fused dSwiGLU): y, dx, d topk-weights and the weight
    (and bias) gradients bit for bit equal; the case has experts whose last tile holds at most 64 rows.
    With biases the gate/up activation runs unfused, so h's padding rows are act(bias), not zero: the down
    GEMM's padding rows then differ, and nothing that is read may."""
    from mok_nn import cuda_backend as cb

    T, H, I, E, k, mode, bias = case
    ids, w, x, dy, W13, W2 = _layer_problem(T, H, I, E, k, mode, seed=T + 2 * I)
    b13 = (torch.randn(E, 2 * I, device="cuda") / 4).to(torch.bfloat16) if bias else None
    b2 = (torch.randn(E, H, device="cuda") / 4).to(torch.bfloat16) if bias else None
    monkeypatch.setenv("MOK_GEMM_PINGPONG", "cluster")
    for var in ("MOK_GEMM_ACT", "MOK_GEMM_DACT"):
        monkeypatch.setenv(var, "fused")
    sched = cb.make_schedule(ids, E)
    tail = sched.seg_rows % 128
    assert bool(((tail > 0) & (tail <= 64)).any()), "no half tile in this case"

    def run(half):
        monkeypatch.setenv("MOK_GEMM_HALF_TILES", half)
        y, saved = cb.experts_forward(x, ids, w, W13, W2, b13, b2)
        dx, dtk, g = cb.experts_backward(dy, saved, x, ids, w, W13, W2, b13, b2)
        torch.cuda.synchronize()
        out = [y, dx, dtk, g.gate_up_proj, g.down_proj]
        return out + ([g.gate_up_bias, g.down_bias] if bias else [])

    want, got, again = run("0"), run("1"), run("1")
    names = ("y", "dx", "d_topk", "d_gate_up_proj", "d_down_proj", "d_gate_up_bias", "d_down_bias")
    for n, a, b, c in zip(names, got, again, want):
        assert torch.equal(_bits(a), _bits(b)), f"{n} not bitwise reproducible"
        assert torch.equal(_bits(a), _bits(c)), f"{n} differs without half tiles"


@pytest.mark.parametrize("case", [(300, 256, 512, 8, 2, "random"), (700, 1024, 512, 16, 8, "skew"),
                                  (1, 256, 256, 4, 1, "random")])
@pytest.mark.parametrize("pp_mode", ["auto", "0"])  # MOK_GEMM_PINGPONG: the defaults, every GEMM cooperative
def test_raster_expert_in_layer(lib, case, pp_mode, monkeypatch):
    """MOK_GEMM_RASTER=expert (one raster band per expert) vs bands through experts_forward / experts_backward:
    y, dx, d topk-weights and both weight gradients bit for bit equal, and equal again on a repeat."""
    from mok_nn import cuda_backend as cb

    T, H, I, E, k, mode = case
    ids, w, x, dy, W13, W2 = _layer_problem(T, H, I, E, k, mode, seed=T + H)
    monkeypatch.setenv("MOK_GEMM_PINGPONG", pp_mode)

    def run(raster):
        monkeypatch.setenv("MOK_GEMM_RASTER", raster)
        y, saved = cb.experts_forward(x, ids, w, W13, W2)
        dx, dtk, g = cb.experts_backward(dy, saved, x, ids, w, W13, W2)
        torch.cuda.synchronize()
        return [y, dx, dtk, g.gate_up_proj, g.down_proj]

    want, got, again = run("bands"), run("expert"), run("expert")
    for n, a, b, c in zip(("y", "dx", "d_topk", "d_gate_up_proj", "d_down_proj"), got, again, want):
        assert not torch.isnan(a).any(), f"{n}: NaN"
        assert torch.equal(_bits(a), _bits(b)), f"{n} not bitwise reproducible"
        assert torch.equal(_bits(a), _bits(c)), f"{n} differs from the bands raster"


# tokens, H, I, E, k, routing, biases. I = 768: the dgrad of gate/up (K = 2I) is cooperative under the defaults;
# H = 4608: the dgrad of down runs unfused (mok_gemm_bn_f32), as at deepseek-v3
@pytest.mark.parametrize("case", [(300, 256, 512, 8, 2, "random", False), (700, 1024, 768, 16, 8, "skew", False),
                                  (1, 256, 768, 4, 1, "random", False), (300, 256, 768, 8, 2, "random", True),
                                  (200, 4608, 640, 6, 2, "skew", False)])
@pytest.mark.parametrize("pp_mode", ["auto", "0"])  # MOK_GEMM_PINGPONG: the defaults, every GEMM cooperative
def test_dynamic_tiles_in_layer(lib, case, pp_mode, monkeypatch, launched_kernels):
    """MOK_GEMM_TILES=dynamic (the cooperative GEMMs with dynamic tiles, all-padding warp groups skipping their
    MMA) vs static through experts_forward / experts_backward: y, dx, d topk-weights and the weight (and bias)
    gradients bit for bit equal, and equal again on a repeat. With biases h's padding rows are act(bias), so the
    down GEMM's padding rows (read by nothing) differ; nothing that is read may."""
    from mok_nn import cuda_backend as cb

    T, H, I, E, k, mode, bias = case
    ids, w, x, dy, W13, W2 = _layer_problem(T, H, I, E, k, mode, seed=T + H + 3)
    b13 = (torch.randn(E, 2 * I, device="cuda") / 4).to(torch.bfloat16) if bias else None
    b2 = (torch.randn(E, H, device="cuda") / 4).to(torch.bfloat16) if bias else None
    monkeypatch.setenv("MOK_GEMM_PINGPONG", pp_mode)
    launched = launched_kernels

    def run(tiles):
        monkeypatch.setenv("MOK_GEMM_TILES", tiles)
        launched.clear()
        y, saved = cb.experts_forward(x, ids, w, W13, W2, b13, b2)
        dx, dtk, g = cb.experts_backward(dy, saved, x, ids, w, W13, W2, b13, b2)
        torch.cuda.synchronize()
        dyn = [n for n in launched if n.endswith("_dyn")]
        assert bool(dyn) == (tiles == "dynamic" and (pp_mode == "0" or I != 512)), (tiles, launched)
        return [y, dx, dtk, g.gate_up_proj, g.down_proj] + ([g.gate_up_bias, g.down_bias] if bias else [])

    want, got, again = run("static"), run("dynamic"), run("dynamic")
    names = ("y", "dx", "d_topk", "d_gate_up_proj", "d_down_proj", "d_gate_up_bias", "d_down_bias")
    for n, a, b, c in zip(names, got, again, want):
        assert not torch.isnan(a).any(), f"{n}: NaN"
        assert torch.equal(_bits(a), _bits(b)), f"{n} not bitwise reproducible"
        assert torch.equal(_bits(a), _bits(c)), f"{n} differs from static tiles"


@pytest.mark.parametrize("T,H,M", [(1, 8, 128), (333, 200, 1024), (4097, 2048, 9000), (64, 7168, 640)])
def test_gather_rows_kernel(lib, T, H, M, monkeypatch):
    """mok_gather_rows (MOK_GATHER_ROWS=kernel): row idx[r] of src, a zero row where idx[r] == T; the bits of
    the torch path, every output row written (poisoned first), and the EP form (a zero last row in src)."""
    from mok_nn import cuda_backend as cb

    g = torch.Generator(device="cuda").manual_seed(T + H)
    src = torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16)
    idx = torch.randint(0, T + 1, (M,), device="cuda", generator=g)  # T: a padding row
    idx[: min(M, 3)] = T
    want = torch.cat([src, src.new_zeros(1, H)])[idx]
    monkeypatch.setenv("MOK_GATHER_ROWS", "kernel")
    got = cb.take_rows(src, idx)
    assert torch.equal(got, want)
    with_zero = torch.cat([src, src.new_zeros(1, H)])
    assert torch.equal(cb.take_rows(with_zero, idx, has_zero_row=True), want)
    poisoned = torch.full((M, H), float("nan"), device="cuda", dtype=torch.bfloat16)
    all_rows = torch.zeros(1, dtype=torch.int32, device="cuda")  # a tile table that skips no row
    cb._lib().launch("mok_gather_rows", src, idx, all_rows, poisoned, 3, stream=torch.cuda.current_stream().cuda_stream)
    assert torch.equal(poisoned, want), "a small grid (grid-stride) must write every row too"
    # a view at an odd element offset cannot be read in 16-byte vectors: the torch path, same rows
    flat = torch.cat([src.new_zeros(1), src.reshape(-1)])
    odd = flat[1:].view(T, H)
    assert odd.data_ptr() % 16 != 0
    assert torch.equal(cb.take_rows(odd, idx), want)
    monkeypatch.setenv("MOK_GATHER_ROWS", "torch")
    assert torch.equal(cb.take_rows(src, idx), want)


@pytest.mark.parametrize("T,H,k,E,mode", [(1, 8, 1, 4, "uniform"), (333, 200, 4, 16, "uniform"),
                                          (4097, 2048, 8, 128, "uniform"), (64, 7168, 8, 256, "uniform"),
                                          (500, 1024, 2, 8, "one_expert"), (300, 384, 6, 32, "skew")])
def test_scatter_rows_kernel(lib, T, H, k, E, mode, monkeypatch):
    """mok_scatter_rows (MOK_GATHER_ROWS=scatter): from the source side, the rows of a real schedule, the bits
    of index_select with a zero row (every row poisoned first, also with a grid of 3 CTAs); with the schedule's
    tile table (skip_tail, both gather kernels) the rows past the last segment untouched; and the EP form: a
    source with a zero row last, slots naming another source's row or a row past a capacity cut (not
    written by that source), padding rows naming the zero row or anything out of range."""
    from mok_nn import cuda_backend as cb

    ids, _ = _routing(T, k, E, mode, seed=T + H)
    sched = cb.make_schedule(ids, E)
    g = torch.Generator(device="cuda").manual_seed(T * H)
    src = torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16)
    want = torch.cat([src, src.new_zeros(1, H)])[sched.row_token]
    monkeypatch.setenv("MOK_GATHER_ROWS", "scatter")
    got = cb.gather_rows(src, sched)
    assert torch.equal(got, want)
    stream = torch.cuda.current_stream().cuda_stream
    poisoned = torch.full_like(want, float("nan"))
    all_rows = torch.zeros(1, dtype=torch.int32, device="cuda")  # a tile table that skips no row
    cb._lib().launch("mok_scatter_rows", src, sched.pos.contiguous(), sched.row_token, all_rows, poisoned, 3,
                     stream=stream)
    assert torch.equal(poisoned, want), "a small grid (grid-stride) must write every row too"
    # skip_tail: the rows of tiles past the last segment stay as they were (poison), the others as before
    tail = (sched.tile_expert < 0).repeat_interleave(128)
    for mode in ("scatter", "kernel"):
        monkeypatch.setenv("MOK_GATHER_ROWS", mode)
        got = cb.gather_rows(src, sched, skip_tail=True)
        assert torch.equal(got[~tail], want[~tail]), mode
        probe = torch.full_like(want, float("nan"))
        name, args = (("mok_scatter_rows", (src, sched.pos, sched.row_token)) if mode == "scatter"
                      else ("mok_gather_rows", (src, sched.row_token)))
        cb._lib().launch(name, *args, sched.tile_expert, probe, 3, stream=stream)
        assert torch.equal(probe[~tail], want[~tail]), mode
        assert probe[tail].isnan().all(), f"{mode}: a row past the last segment was written"
    monkeypatch.setenv("MOK_GATHER_ROWS", "scatter")
    # EP form: src has one more row (zero, as the EP sections keep it); the last 128 rows are cut off (a
    # smaller capacity: slots past them have no row); padding rows name the zero row, -1 or 10**9; and each
    # source gets one more slot naming a row of another source (or past the end), which it must not write
    m = max(1, sched.row_token.shape[0] - 128)
    row_src = sched.row_token[:m].clone()
    pad = (row_src == T).nonzero().flatten()
    row_src[pad] = torch.tensor([T, -1, 10**9], device="cuda")[torch.arange(pad.numel(), device="cuda") % 3]
    foreign = sched.pos[(torch.arange(T, device="cuda") + 1) % T, 0] if T > 1 else torch.full((1,), 10**9,
                                                                                           device="cuda")
    slots = torch.cat([sched.pos, foreign[:, None]], dim=1)
    with_zero = torch.cat([src, src.new_zeros(1, H)])
    want_ep = with_zero[torch.where((row_src >= 0) & (row_src < T), row_src, T)]
    for grid in (3, 64):
        out = torch.full((m, H), float("nan"), device="cuda", dtype=torch.bfloat16)
        cb._lib().launch("mok_scatter_rows", with_zero, slots, row_src, all_rows, out, grid, stream=stream)
        assert torch.equal(out, want_ep), grid
    assert torch.equal(cb.take_rows(with_zero, row_src, has_zero_row=True, slots=slots), want_ep)
    monkeypatch.setenv("MOK_GATHER_ROWS", "kernel")  # the gather kernel on the same rows (its zero row: T)
    assert torch.equal(cb.take_rows(with_zero, torch.where((row_src >= 0) & (row_src < T), row_src, T),
                                    has_zero_row=True), want_ep)


@pytest.mark.parametrize("P,tc,H,k,E", [(2, 333, 200, 4, 16), (2, 4096, 2048, 8, 128), (3, 64, 7168, 8, 24),
                                        (4, 1, 8, 1, 4)])
def test_scatter_rows_peers_kernel(lib, P, tc, H, k, E):
    """mok_scatter_rows_peers (MOK_EP_PULL=scatter): P sections on this GPU stand for the ranks' sections, each
    holding only its own rows p*Tc.. (every other row NaN, so a row read from the wrong section shows); the
    rows of a real schedule over the P*Tc token rows equal index_select over the rows put together (every
    output row poisoned first; grids of 3 and 64 CTAs); slots past a capacity cut are not written; with the
    tile table the rows past the last segment stay untouched."""
    from mok_nn import cuda_backend as cb

    n = P * tc
    ids, _ = _routing(n, k, E, "uniform", seed=n + H)
    sched = cb.make_schedule(ids, E)
    g = torch.Generator(device="cuda").manual_seed(n * H + P)
    rows = torch.randn(n, H, device="cuda", generator=g).to(torch.bfloat16)
    sections = []
    for p in range(P):
        s = torch.full((n + 1, H), float("nan"), device="cuda", dtype=torch.bfloat16)
        s[p * tc:(p + 1) * tc] = rows[p * tc:(p + 1) * tc]
        s[n] = 0  # the sections' zero row (unused here: padding rows are zero-filled)
        sections.append(s)
    base = torch.tensor([s.data_ptr() for s in sections], dtype=torch.int64, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream
    all_rows = torch.zeros(1, dtype=torch.int32, device="cuda")
    m = max(1, sched.row_token.shape[0] - 128)  # a capacity cut: the slots of the last rows are not written
    row_src = sched.row_token[:m]
    want = torch.cat([rows, rows.new_zeros(1, H)])[row_src]
    for local in (0, P - 1):  # the "local" section only lends its row stride
        for grid in (3, 64):
            out = torch.full((m, H), float("nan"), device="cuda", dtype=torch.bfloat16)
            cb._lib().launch("mok_scatter_rows_peers", sections[local], base, sched.pos.contiguous(), row_src,
                             all_rows, out, grid, stream=stream)
            assert torch.equal(out, want), (local, grid)
    tail = (sched.tile_expert < 0).repeat_interleave(128)[:m]
    probe = torch.full((m, H), float("nan"), device="cuda", dtype=torch.bfloat16)
    cb._lib().launch("mok_scatter_rows_peers", sections[0], base, sched.pos.contiguous(), row_src,
                     sched.tile_expert, probe, 5, stream=stream)
    assert torch.equal(probe[~tail], want[~tail])
    assert probe[tail].isnan().all(), "a row past the last segment was written"
