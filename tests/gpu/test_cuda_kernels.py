"""CuTe DSL kernels and the CUDA experts path against fp64 oracles (needs an sm_90 GPU).

Every kernel of the one-GPU path is launched here directly (with the arguments cuda_backend gives it)
and through its cuda_backend helper. Outputs are poisoned (NaN) before each launch, so an unwritten
row shows; each result is computed twice and must repeat bit for bit. The layer tests check which
kernels run (the launched_kernels fixture) against the rules in cuda_backend.
"""

import pytest
import torch

from mok_nn.kernels import registry

from layer_runs import rel_err as rel_l2, slot_products

cuda_ok = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
pytestmark = pytest.mark.skipif(not cuda_ok, reason="needs an sm_90 CUDA GPU")

BF16_TOL = 1e-2  # relative L2 error allowed for bf16 operands / outputs
EDGE_COUNTS = [1, 63, 0, 64, 65, 127, 128, 129, 200]  # rows per expert around the 64-row halves of a tile


@pytest.fixture(scope="module")
def lib():
    from mok_nn import cuda_backend as cb

    return cb._lib()


def _stream():
    return torch.cuda.current_stream().cuda_stream


def _bits(t):
    """t's raw bits (so that -0.0 and +0.0 differ, which torch.equal does not see)."""
    return t.contiguous().view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _edge_routing(g):
    """Top-1 ids giving expert e exactly EDGE_COUNTS[e] rows, in a random token order."""
    counts = torch.tensor(EDGE_COUNTS, device="cuda")
    flat = torch.repeat_interleave(torch.arange(len(EDGE_COUNTS), device="cuda"), counts)
    return flat[torch.randperm(flat.numel(), device="cuda", generator=g)].view(-1, 1)


def _routing(num_tokens, top_k, num_experts, mode, seed):
    """(ids [T, k], weights [T, k] fp32). mode: random; skew (the upper half of the experts gets no tokens);
    one_expert (slot j -> expert j: expert 0 takes every token); edge (top-1, expert e gets EDGE_COUNTS[e]
    rows: T = sum(EDGE_COUNTS), k = 1, E = len(EDGE_COUNTS))."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    if mode == "one_expert":
        ids = torch.zeros(num_tokens, top_k, dtype=torch.int64, device="cuda")
        ids += torch.arange(top_k, device="cuda")
    elif mode == "edge":
        assert (num_tokens, top_k, num_experts) == (sum(EDGE_COUNTS), 1, len(EDGE_COUNTS))
        ids = _edge_routing(g)
    else:
        logits = torch.randn(num_tokens, num_experts, device="cuda", generator=g)
        if mode == "skew":
            logits[:, num_experts // 2 :] -= 30
        ids = torch.topk(logits, top_k, dim=1).indices
    w = torch.rand(num_tokens, top_k, device="cuda", generator=g)
    return ids, w


EDGE_T = sum(EDGE_COUNTS)
GEMM_CASES = [  # tokens, k, E, N, K, routing
    (256, 2, 8, 512, 256, "random"),
    (1, 1, 4, 256, 128, "random"),
    (333, 2, 8, 384, 200, "skew"),  # N, K not tile multiples; empty experts
    (300, 1, 3, 1000, 72, "one_expert"),
    (3000, 2, 6, 2048, 128, "skew"),  # 4-8 row tiles per expert, 8 column tiles: bands span several waves
    (EDGE_T, 1, 9, 512, 320, "edge"),  # last tiles 1, 63, 64, 65, 127, 128, 1 (129) rows full; an empty expert
    (EDGE_T, 1, 9, 384, 200, "edge"),  # the same with K % 64 = 8: the last k tile mostly past K
    (256, 8, 32, 512, 7168, "random"),  # 112 k tiles: the stage ring wraps often
]


def _case_id(c):
    return "T{}k{}E{}N{}K{}-{}".format(*c)


# Every plain varlen-M grouped GEMM of the one-GPU path (cuda_backend.gemm_kernel picks one per reduction
# length K): registry name -> (B read transposed (dgrad), output dtype)
GEMM_KERNELS = {
    "mok_gemm_bk": (False, torch.bfloat16),
    "mok_gemm_bk_ppc": (False, torch.bfloat16),
    "mok_gemm_bk_ef_dyn": (False, torch.bfloat16),
    "mok_gemm_bn": (True, torch.bfloat16),
    "mok_gemm_bn_ppc": (True, torch.bfloat16),
    "mok_gemm_bn_ef_dyn": (True, torch.bfloat16),
    "mok_gemm_bn_f32_dyn": (True, torch.float32),
}


def test_gemm_kernels_listed():
    plain = {s.name for s in registry.SPECS if s.factory in ("VarlenMGroupedGemm", "VarlenMGroupedGemmDyn")}
    assert plain == set(GEMM_KERNELS)
    assert set(registry.GEMM_DYN_KERNELS) == {n for n in GEMM_KERNELS if n.endswith("_dyn")}


def _gemm_problem(case, transpose_w, seed):
    """(ids, schedule, x [T, K], x rows in schedule order (every row written), W) of a GEMM_CASES case."""
    from mok_nn import cuda_backend as cb

    T, k, E, N, K, mode = case
    ids, _ = _routing(T, k, E, mode, seed=seed)
    sched = cb.make_schedule(ids, E)
    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    x = torch.randn(T, K, device="cuda", generator=g).to(torch.bfloat16)
    W = (torch.randn((E, K, N) if transpose_w else (E, N, K), device="cuda", generator=g) / K**0.5).to(torch.bfloat16)
    return ids, sched, x, cb.gather_rows(x, sched), W


def _run_gemm(lib, name, a, W, sched, group_m):
    """One launch of plain GEMM `name` into a NaN-poisoned output, with the seg_rows the layer gives it
    (Schedule.seg_rows_for: the routed rows for _ppc and _dyn, the padded sizes otherwise) and, for a _dyn
    kernel, a zeroed tile counter. Returns (out, the counter after the launch, or None)."""
    transpose_w, out_dtype = GEMM_KERNELS[name]
    out = torch.full((a.shape[0], W.shape[2] if transpose_w else W.shape[1]), float("nan"), device="cuda",
                     dtype=out_dtype)
    b = W.permute(2, 1, 0) if transpose_w else W.permute(1, 2, 0)
    counter = (torch.zeros(1, dtype=torch.int32, device="cuda"),) if name.endswith("_dyn") else ()
    lib.launch(name, a.unsqueeze(-1), b, out.unsqueeze(-1), sched.tile_expert, sched.seg_end,
               sched.seg_rows_for(name), group_m, *counter, stream=_stream())
    torch.cuda.synchronize()
    return out, (int(counter[0]) if counter else None)


@pytest.mark.parametrize("name", list(GEMM_KERNELS))
@pytest.mark.parametrize("case", GEMM_CASES, ids=_case_id)
@pytest.mark.parametrize("group_m", [1, 0, 8])  # the layer gives 0 (a band per expert) or 8 (gemm_group_m)
def test_grouped_gemm(lib, name, case, group_m):
    """Each plain GEMM into a NaN-poisoned output: every used row written, the same raw bits on a repeat and
    for any raster (group_m), real rows within bf16 rounding of fp64, padding rows inside the segments +0,
    a _dyn kernel's counter showing every CTA claimed until it ran dry (tiles + grid claims). The forms sum
    each output element over K in the same order: the raw bits of the split-epilogue kernel (mok_gemm_bk /
    mok_gemm_bn; the fp32 output rounded to bf16), whichever form gemm_kernel picks."""
    transpose_w, _ = GEMM_KERNELS[name]
    T, k, E, N, K, mode = case
    ids, sched, x, a, W = _gemm_problem(case, transpose_w, seed=T + N + K)
    (got, claims), (again, _) = _run_gemm(lib, name, a, W, sched, group_m), _run_gemm(lib, name, a, W, sched, group_m)
    used = int(sched.seg_end[-1])
    pos = sched.pos.reshape(-1)
    assert not torch.isnan(got[:used]).any(), "rows left unwritten"
    assert torch.equal(_bits(got[:used]), _bits(again[:used])), "not bitwise reproducible"
    assert rel_l2(got[pos], slot_products(x, ids, W, transpose_w)) < BF16_TOL
    pad = torch.ones(used, dtype=torch.bool, device="cuda")
    pad[pos] = False
    assert torch.all(_bits(got[:used][pad]) == 0), "padding rows not +0"
    if claims is not None:
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        tiles = (a.shape[0] // registry.TILE_M) * -(-N // registry.tile_n_of(name))
        assert claims == tiles + min(tiles, sms), (claims, tiles)
    if group_m != 1:  # the tile order changes which CTA computes a tile, never its bits
        col_fastest, _ = _run_gemm(lib, name, a, W, sched, 1)
        assert torch.equal(_bits(got[:used]), _bits(col_fastest[:used])), f"group_m={group_m} differs from 1"
    split = "mok_gemm_bn" if transpose_w else "mok_gemm_bk"
    if name != split:
        want, _ = _run_gemm(lib, split, a, W, sched, 1)
        assert torch.equal(_bits(got[:used].to(torch.bfloat16)), _bits(want[:used])), f"{name} differs from {split}"


@pytest.mark.parametrize("K,form", [(384, "_ppc"), (1024, "_ppc"), (1032, "_ef_dyn"), (8192, "_ef_dyn"),
                                    (8200, "")])
@pytest.mark.parametrize("transpose_w,out_dtype", [(False, torch.bfloat16), (True, torch.bfloat16),
                                                   (True, torch.float32)], ids=["bk", "bn", "bn_f32"])
def test_grouped_gemm_runs_the_rule_kernel(lib, launched_kernels, K, form, transpose_w, out_dtype):
    """cuda_backend.grouped_gemm launches the form gemm_kernel names for its reduction length (clustered
    ping-pong where K <= PINGPONG_MAX_K["gemm"], whole-tile epilogue with dynamic tiles where
    K <= GEMM_FULL_EPI_MAX_K, else the split epilogue; fp32 output: mok_gemm_bn_f32_dyn at any K), with the
    bits of a direct launch of that kernel and within bf16 rounding of fp64."""
    from mok_nn import cuda_backend as cb

    case = (300, 2, 8, 384, K, "skew")
    ids, sched, x, a, W = _gemm_problem(case, transpose_w, seed=K)
    want_name = "mok_gemm_bn_f32_dyn" if out_dtype == torch.float32 else ("mok_gemm_bn" if transpose_w
                                                                         else "mok_gemm_bk") + form
    assert cb.gemm_kernel(transpose_w, out_dtype, k=K) == want_name
    assert (K <= cb.PINGPONG_MAX_K["gemm"]) == (form == "_ppc")
    assert (cb.PINGPONG_MAX_K["gemm"] < K <= cb.GEMM_FULL_EPI_MAX_K) == (form == "_ef_dyn")
    launched_kernels.clear()
    got = cb.grouped_gemm(a, W, sched, transpose_w=transpose_w, out_dtype=out_dtype)
    torch.cuda.synchronize()
    assert launched_kernels == [want_name]
    used = int(sched.seg_end[-1])
    direct, _ = _run_gemm(lib, want_name, a, W, sched, cb.gemm_group_m(384, registry.tile_n_of(want_name)))
    assert torch.equal(_bits(got[:used]), _bits(direct[:used]))
    assert rel_l2(got[sched.pos.reshape(-1)], slot_products(x, ids, W, transpose_w)) < BF16_TOL


PUSH_CASES = [  # tokens, k, E, N (output columns), K, routing
    (300, 2, 8, 256, 128, "random"),
    (257, 4, 16, 384, 192, "skew"),  # a last column tile past N, empty experts
    (1, 1, 4, 512, 256, "random"),
    (2048, 8, 32, 2048, 768, "random"),  # qwen3-like down GEMM
    (EDGE_T, 1, 9, 256, 320, "edge"),
]


@pytest.mark.parametrize("case", PUSH_CASES, ids=_case_id)
@pytest.mark.parametrize("transpose_w", [False, True])  # mok_gemm_bk_ef_push / mok_gemm_bn_ef_push
def test_grouped_gemm_push(lib, case, transpose_w):
    """mok_gemm_b{k,n}_ef_push (cb.grouped_gemm_push): row r of the GEMM lands in row slot[r] of destination
    rank[r] (two destination tensors standing in for two ranks' sections, poisoned with NaN; padding rows sent
    nowhere): within bf16 rounding of fp64, bitwise grouped_gemm's rows, every other destination row
    untouched, the same on a repeat."""
    from mok_nn import cuda_backend as cb

    T, k, E, N, K, mode = case
    ids, sched, x, a, W = _gemm_problem(case, transpose_w, seed=T + N)
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
    got = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
    for p in range(2):
        sel = rank == p
        got[sel] = outs[0][p][slot[sel]]
        assert torch.equal(outs[0][p][slot[sel]], want[sel]), f"rank {p}: rows differ from grouped_gemm"
        untouched = torch.ones(M, dtype=torch.bool, device="cuda")
        untouched[slot[sel]] = False
        assert torch.isnan(outs[0][p][untouched]).all(), f"rank {p}: rows written that were not sent there"
        assert torch.equal(_bits(outs[0][p]), _bits(outs[1][p])), "not reproducible"
    assert int(real.sum()) == T * k
    pos = sched.pos.reshape(-1)
    assert not torch.isnan(got[pos]).any(), "a routed row was not sent"
    assert rel_l2(got[pos], slot_products(x, ids, W, transpose_w)) < BF16_TOL


WGRAD_CASES = [  # tokens, k, E, Na, Nb, routing
    (256, 2, 8, 512, 256, "random"),
    (1, 1, 4, 256, 128, "random"),
    (333, 2, 8, 200, 1000, "skew"),  # Na, Nb not multiples of the tile; experts without rows
    (300, 1, 3, 136, 72, "one_expert"),  # one expert over several K tiles, two empty ones
    (700, 4, 16, 384, 8448, "random"),  # Nb spans > 32 column tiles: banded raster
    (400, 2, 8, 384, 512, "random"),  # 3 row tiles: the clustered kernels' last pair has a row past M
    (4096, 2, 8, 256, 2048, "random"),  # 1024 rows per expert: wgrad_kernel picks mok_gemm_wgrad_defer_c2
]


def _wgrad_launch(lib, name, a, b, sched, counts, group_m=None):
    """One launch of weight-gradient kernel `name` into a NaN-poisoned [E, Na, Nb] output."""
    from mok_nn import cuda_backend as cb

    out = torch.full((sched.num_experts, a.shape[1], b.shape[1]), float("nan"), device="cuda", dtype=torch.bfloat16)
    group_m = cb.wgrad_group_m(name, b.shape[1]) if group_m is None else group_m
    lib.launch(name, a.t().unsqueeze(-1), b.t().unsqueeze(-1), out.permute(1, 2, 0), sched.seg_end, counts,
               group_m, stream=_stream())
    torch.cuda.synchronize()
    return out


def _check_wgrad(got, a, b, ids, sched):
    """Per expert, against its routed rows only (fp64), from the slot order, not the schedule."""
    assert not torch.isnan(got).any(), "outputs left unwritten"
    pos = sched.pos.reshape(-1)
    flat = ids.reshape(-1)
    for e in range(sched.num_experts):
        rows = pos[flat == e]
        if rows.numel() == 0:
            assert torch.all(got[e] == 0), f"expert {e} without rows: nonzero gradient"
            continue
        err = rel_l2(got[e], a[rows].double().t() @ b[rows].double())
        assert err < BF16_TOL, (e, err)


@pytest.mark.parametrize("kernel", registry.WGRAD_KERNELS)
@pytest.mark.parametrize("case", WGRAD_CASES, ids=_case_id)
def test_weight_grad_gemm(lib, case, kernel, launched_kernels):
    """mok_gemm_wgrad_defer_c2 / mok_gemm_wgrad_pp: per expert, A rows^T @ B rows over that expert's rows
    only; cb.weight_grad launches the kernel wgrad_kernel picks, with its bits."""
    from mok_nn import cuda_backend as cb

    T, k, E, Na, Nb, mode = case
    ids, _ = _routing(T, k, E, mode, seed=3 * T + Na)
    sched = cb.make_schedule(ids, E)
    a = cb.gather_rows(torch.randn(T, Na, device="cuda", dtype=torch.bfloat16), sched)
    b = cb.gather_rows(torch.randn(T, Nb, device="cuda", dtype=torch.bfloat16), sched)
    counts = cb.expert_row_counts(ids, E)
    assert torch.equal(counts.long(), torch.bincount(ids.reshape(-1), minlength=E))
    got, again = (_wgrad_launch(lib, kernel, a, b, sched, counts) for _ in range(2))
    assert torch.equal(_bits(got), _bits(again)), "not bitwise reproducible"
    _check_wgrad(got, a, b, ids, sched)
    chosen = cb.wgrad_kernel(sched, Nb)
    short = T * k / E <= cb.WGRAD_SHORT_MAX_ROWS and Nb <= cb.WGRAD_SHORT_MAX_COLS
    assert chosen == ("mok_gemm_wgrad_pp" if short else "mok_gemm_wgrad_defer_c2")
    launched_kernels.clear()
    public = cb.weight_grad(a, b, sched, counts)
    torch.cuda.synchronize()
    assert launched_kernels == [chosen]
    if chosen == kernel:
        assert torch.equal(_bits(public), _bits(got))


WGRAD_EDGE_CASES = [  # rows per expert (top-1 routing, tokens shuffled), Na, Nb
    ((0, 1, 64, 65, 0, 128, 129, 3), 200, 392),  # K tile edges, empty experts, partial M and N tiles
    # ~4 output tiles per CTA, short K: epilogue buffers reused across tiles; every 16-row
    # position of an expert's last row in its K tile
    ((1, 64, 65, 0, 17, 130, 33, 48, 100, 7, 2, 64, 111, 0, 16, 81), 1024, 1536),
]


def _wgrad_edge_problem(case, seed_base):
    """(ids, schedule, counts, A rows, B rows, generator) of a WGRAD_EDGE_CASES case: top-1 routing with the
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


@pytest.mark.parametrize("case", WGRAD_EDGE_CASES, ids=["edges", "many_tiles"])
@pytest.mark.parametrize("group_m", [None, 8])  # None: wgrad_group_m's raster (1 here)
def test_weight_grad_kernels_edges(lib, case, group_m):
    """Both weight-gradient kernels at the tile edges, each within bf16 rounding of fp64 and repeating bit for
    bit; they keep the K order and the one bf16 rounding, so wgrad_kernel's choice between them by shape
    never changes the bits: the same raw bits, for any raster."""
    ids, sched, counts, a, b, _ = _wgrad_edge_problem(case, seed_base=0)
    outs = {}
    for name in registry.WGRAD_KERNELS:
        got, again = (_wgrad_launch(lib, name, a, b, sched, counts, group_m) for _ in range(2))
        assert torch.equal(_bits(got), _bits(again)), f"{name} not bitwise reproducible"
        _check_wgrad(got, a, b, ids, sched)
        outs[name] = got
    first, *others = registry.WGRAD_KERNELS
    for name in others:
        assert torch.equal(_bits(outs[name]), _bits(outs[first])), f"{name} differs from {first}"
    if group_m is not None:
        for name in registry.WGRAD_KERNELS:
            assert torch.equal(_bits(outs[name]), _bits(_wgrad_launch(lib, name, a, b, sched, counts))), name


@pytest.mark.parametrize("case", WGRAD_EDGE_CASES, ids=["edges", "many_tiles"])
def test_weight_grad_accumulates(lib, case, launched_kernels):
    """weight_grad(into=): mok_gemm_wgrad_defer_c2_acc adds the bf16 result into `into` in its stores; every
    element is bf16(into + the plain result), the add of two bf16 values rounded once. Where `into` is
    not a contiguous bf16 tensor the same sum is formed outside the kernel."""
    from mok_nn import cuda_backend as cb

    _, sched, counts, a, b, g = _wgrad_edge_problem(case, seed_base=1)
    E, Na, Nb = len(case[0]), case[1], case[2]
    plain = cb.weight_grad(a, b, sched, counts)
    before = torch.randn(E, Na, Nb, device="cuda", generator=g).to(torch.bfloat16) * 8
    want = (before.float() + plain.float()).to(torch.bfloat16)  # exact in fp32, then one rounding
    assert registry.WGRAD_ACC_KERNELS == {"mok_gemm_wgrad_defer_c2": "mok_gemm_wgrad_defer_c2_acc"}
    outs = []
    for _ in range(2):
        into = before.clone()
        launched_kernels.clear()
        got = cb.weight_grad(a, b, sched, counts, into=into)
        torch.cuda.synchronize()
        assert launched_kernels == ["mok_gemm_wgrad_defer_c2_acc"]
        assert got is into, "weight_grad(into=) must return the tensor it added into"
        outs.append(into)
    assert torch.equal(_bits(outs[0]), _bits(outs[1])), "not bitwise reproducible"
    assert torch.equal(outs[0], want), f"{(outs[0] != want).sum().item()} elements differ from bf16(into + result)"
    # a non-contiguous gradient (same values): the result computed apart, then added
    strided = before.transpose(1, 2).contiguous().transpose(1, 2)
    assert not strided.is_contiguous()
    launched_kernels.clear()
    cb.weight_grad(a, b, sched, counts, into=strided)
    torch.cuda.synchronize()
    assert launched_kernels == [cb.wgrad_kernel(sched, Nb)]
    assert torch.equal(strided, want)


@pytest.mark.parametrize("case", WGRAD_EDGE_CASES, ids=["edges", "many_tiles"])
@pytest.mark.parametrize("accumulate", [False, True])
def test_weight_grad_into_column_blocks(lib, case, accumulate, launched_kernels):
    """weight_grad(out= / into=) on column blocks of a gradient (gate_up_weight_grad's blocks; and blocks of 8 and
    40 columns): the kernel stores into each block's view itself, the kernel the whole gradient's width picks
    (cols), and the blocks give the bits of the whole gradient in one call."""
    from mok_nn import cuda_backend as cb

    _, sched, counts, a, b, g = _wgrad_edge_problem(case, seed_base=2)
    E, Na, Nb = len(case[0]), case[1], case[2]
    before = torch.randn(E, Na, Nb, device="cuda", generator=g).to(torch.bfloat16) * 8
    whole = cb.weight_grad(a, b, sched, counts, into=before.clone() if accumulate else None)
    name = cb.wgrad_kernel(sched, Nb, accumulate)
    kernel = registry.WGRAD_ACC_KERNELS[name] if accumulate else name
    for blocks in (cb.x_column_blocks(Nb, 10**6), [(0, 8), (8, 48), (48, Nb)]):
        grad = before.clone() if accumulate else torch.full_like(before, float("nan"))
        launched_kernels.clear()
        for c0, c1 in blocks:
            block = grad[:, :, c0:c1]
            got = cb.weight_grad(a, b[:, c0:c1].contiguous(), sched, counts, cols=Nb,
                                 **({"into": block} if accumulate else {"out": block}))
            assert got.data_ptr() == block.data_ptr()
        torch.cuda.synchronize()
        assert launched_kernels == [kernel] * len(blocks), launched_kernels
        assert torch.equal(_bits(grad), _bits(whole)), f"blocks {blocks}: not the whole gradient's bits"


def _combine_problem(T, k, H, E, seed):
    """rows [T*k + 5, H] bf16, pos [T, k] (distinct rows), w [T, k] fp32, ids [T, k] (distinct experts per token)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    R = T * k + 5
    rows = torch.randn(R, H, device="cuda", dtype=torch.bfloat16, generator=g)
    pos = torch.randperm(R, device="cuda", generator=g)[: T * k].view(T, k)
    w = torch.rand(T, k, device="cuda", generator=g)
    ids = torch.rand(T, E, device="cuda", generator=g).argsort(dim=1)[:, :k].contiguous()
    return rows, pos, w, ids


COMBINE_KERNELS = ("mok_combine", "mok_combine_cp")


@pytest.mark.parametrize("T,k,H,E", [(1, 1, 8, 8), (513, 8, 2048, 128), (64, 2, 7168, 8), (100, 4, 256, 6),
                                     (37, 17, 264, 64),  # top_k > 16: mok_combine
                                     (5, 32, 72, 64)])  # top_k = 32: every lane holds a slot
def test_combine(lib, launched_kernels, T, k, H, E):
    """cb.combine launches mok_combine_cp where top_k <= 16, else mok_combine; within one bf16 rounding of the
    fp64 sum, bitwise reproducible."""
    from mok_nn import cuda_backend as cb

    rows, pos, w, ids = _combine_problem(T, k, H, E, seed=T + E)
    launched_kernels.clear()
    ys = [cb.combine(rows, pos, w, ids, E, torch.bfloat16) for _ in range(2)]
    torch.cuda.synchronize()
    assert launched_kernels == ["mok_combine_cp" if k <= registry.COMBINE_STAGED_ENTRIES else "mok_combine"] * 2
    assert torch.equal(_bits(ys[0]), _bits(ys[1]))
    ref = (rows.double()[pos] * w.double()[..., None]).sum(1)
    assert rel_l2(ys[0], ref) < 5e-3  # one bf16 rounding of the fp32 sum
    # the torch stand-in of the same tree (w * row rounded before the add, the kernel fuses them)
    assert rel_l2(ys[0], cb.combine_torch(rows, pos, w, ids, E, torch.float32)) < 5e-3


@pytest.mark.parametrize("k", [1, 2, 3, 8, 16])
def test_combine_kernels(lib, k):
    """Both combine loops (mok_combine: one column chunk at a time; mok_combine_cp: loads staged by cp.async,
    top_k <= 16), each within one bf16 rounding of the fp64 sum, for token counts below and above a thread's
    chunk batch, several batches per token (H past 128 * 16 / k * 8 columns), and slots left out (pos -1).
    Both add the same terms in the same tree order: the same raw bits. Outputs NaN-poisoned first."""
    from mok_nn import cuda_backend as cb

    g = torch.Generator(device="cuda").manual_seed(100 + k)
    for T, H in [(1, 8), (5, 1032), (397, 7168), (2000, 2048)]:
        E = 32
        R = T * k + 3
        rows = torch.randn(R, H, device="cuda", generator=g).to(torch.bfloat16)
        pos = torch.randperm(R, device="cuda", generator=g)[: T * k].view(T, k).contiguous()
        pos[torch.rand(T, k, device="cuda", generator=g) < 0.1] = -1
        w = torch.rand(T, k, device="cuda", generator=g)
        ids = torch.rand(T, E, device="cuda", generator=g).argsort(dim=1)[:, :k].contiguous()
        ref = (rows.double()[pos.clamp(min=0)] * (w.double() * (pos >= 0))[..., None]).sum(1)
        outs = []
        for name in COMBINE_KERNELS:
            runs = []
            for _ in range(2):
                out = torch.full((T, H), float("nan"), device="cuda", dtype=torch.bfloat16)
                cb._lib().launch(name, rows, pos, w, ids, out, cb.experts_per_leaf(E), stream=_stream())
                runs.append(out)
            torch.cuda.synchronize()
            assert not torch.isnan(runs[0]).any(), (name, T, H)
            assert torch.equal(_bits(runs[0]), _bits(runs[1])), (name, T, H)
            assert rel_l2(runs[0], ref) < 5e-3, (name, T, H)
            outs.append(runs[0])
        assert torch.equal(_bits(outs[1]), _bits(outs[0])), (T, H)



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
    """The kernels add in the tree over expert groups, not in slot order: by leaf 2^27, -2^27, 1, 1
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
    for name in COMBINE_KERNELS:
        out = torch.full((1, 8), float("nan"), device="cuda", dtype=torch.bfloat16)
        cb._lib().launch(name, rows, pos, w, ids, out, cb.experts_per_leaf(8), stream=_stream())
        assert out.float().tolist() == [[2.0] * 8], name
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
    (256, 256, 128, 8, 2, "random", "swiglu", None, False),  # I % 256 != 0: the dgrad of down unfused
    (1, 256, 128, 8, 2, "random", "swiglu", None, False),
    (300, 512, 256, 16, 4, "skew", "swiglu", 7.0, False),
    (200, 256, 192, 4, 2, "one_expert", "swiglu_oai", 7.0, True),  # I % 128 != 0, biases
    (300, 256, 768, 8, 2, "random", "swiglu", None, True),  # gate/up bias: mok_act_fwd_swiglu; d gate/up K = 1536
    (300, 256, 512, 8, 2, "skew", "swiglu_oai", 7.0, True),  # biases, the fused dSwiGLU of swiglu_oai
    (EDGE_T, 256, 256, 9, 1, "edge", "swiglu", None, False),  # last tiles 1, 63, 64, 65, ... rows full
    (100, 256, 256, 32, 20, "random", "swiglu", None, False),  # top_k > 16: mok_combine
    (512, 2048, 768, 128, 8, "random", "swiglu", None, False),  # qwen3-30b-a3b, reduced T
    (200, 4608, 640, 6, 2, "skew", "swiglu", None, False),  # H > dact_max_k: the dgrad of down unfused
    (256, 7168, 2048, 256, 8, "random", "swiglu", None, False),  # deepseek-v3, reduced T
    (128, 4096, 14336, 8, 2, "random", "swiglu", None, False),  # mixtral-8x7b, reduced T: K > 8192
]


def _expert_case_id(c):
    return "T{}H{}I{}E{}k{}-{}-{}-{}".format(*c[:8]) + ("-bias" if c[8] else "")


def _rule_kernels(T, H, I, E, k, activation, bias, sched):
    """The kernels experts_forward + experts_backward launch, in order, by the rules in cuda_backend
    (use_fused_act, pingpong, gemm_kernel, _use_fused_dact, wgrad_kernel), where the schedule is made by
    experts_forward (mok_schedule_mc) and the rows gathered by mok_scatter_rows."""
    from mok_nn import cuda_backend as cb

    combine = "mok_combine_cp" if k <= registry.COMBINE_STAGED_ENTRIES else "mok_combine"
    fwd = ["mok_schedule_mc", "mok_scatter_rows"]
    if cb.use_fused_act(I, activation, bias, H):
        fwd.append(f"mok_gemm_gate_up_{activation}" + ("_ppc" if cb.pingpong("act", H) else "_ef"))
    else:
        fwd += [cb.gemm_kernel(False, k=H), f"mok_act_fwd_{activation}"]
    fwd += [cb.gemm_kernel(False, k=I), combine]
    bwd = ["mok_scatter_rows"]
    if cb._use_fused_dact(I, activation, H, torch.device("cuda")):
        bwd.append(f"mok_gemm_dact_{activation}_ppc")
    else:
        bwd += ["mok_gemm_bn_f32_dyn", f"mok_act_bwd_{activation}"]
    # d down_proj right after the dgrad of down; then d x; then d gate_up_proj a column block of x at a time,
    # each block's x rows gathered for it
    bwd += [cb.wgrad_kernel(sched, I), cb.gemm_kernel(True, k=2 * I), combine]
    bwd += ["mok_scatter_rows", cb.wgrad_kernel(sched, H)] * len(cb.x_column_blocks(H, sched.capacity))
    return fwd, bwd


def test_expert_cases_cover_the_layer_kernels():
    """The rules pick, over EXPERT_CASES, every kernel of the one-GPU bf16 experts (the schedule's gather form
    runs through the layer: test_cuda_layer.py; mok_mx_quant, precision="mxfp8"'s: test_mxfp8_cuda.py; the _mx
    and _mxq GEMMs of MXFP8-only weights: test_mx_gemm_cuda.py)."""
    from mok_nn import cuda_backend as cb

    seen = set()
    for T, H, I, E, k, _, act, _, bias in EXPERT_CASES:
        sched = cb.make_schedule_torch(torch.zeros(T, k, dtype=torch.int64), E)
        for part in _rule_kernels(T, H, I, E, k, act, bias, sched):
            seen.update(part)
    layer = {s.name for s in registry.SPECS if not s.name.startswith(("mok_ep_", "mok_combine_final"))
             and not s.name.endswith(("_push", "_acc", "_peers", "_mx", "_mxq", "_mxq_f32"))
             and s.name not in ("mok_schedule_gather", "mok_gather_rows", "mok_mx_quant")}
    assert layer - seen == set()
    # the rules' thresholds, as the cases above assume them
    assert cb.PINGPONG_MAX_K == {"gemm": 1024, "act": 2048} and cb.GEMM_FULL_EPI_MAX_K == 8192
    assert cb.dact_max_k(torch.device("cuda")) in (2048, 4096)


@pytest.mark.parametrize("case", EXPERT_CASES, ids=_expert_case_id)
def test_experts_vs_reference(lib, case, launched_kernels):
    """cb.experts_forward / experts_backward: the kernels the rules name, in order; every output bitwise
    reproducible (raw bits), and within bf16 rounding of the reference backend."""
    from mok_nn import cuda_backend as cb
    from mok_nn import functional

    T, H, I, E, k, mode, act, limit, bias = case
    # the weights, two runs' weight gradients and the oracle's: about 4x the bf16 weights (deepseek-v3's 22.5 GB
    # fit a 141 GB H200, not an 80 GB H100)
    need = 4 * 3 * E * H * I * 2
    if need > torch.cuda.get_device_properties(0).total_memory:
        pytest.skip(f"needs about {need / 2**30:.0f} GiB of GPU memory")
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
        launched_kernels.clear()
        y, saved = cb.experts_forward(x, ids, w, *args)
        n_fwd = len(launched_kernels)
        dx, dw, grads = cb.experts_backward(dy, saved, x, ids, w, *args)
        torch.cuda.synchronize()
        fwd, bwd = _rule_kernels(T, H, I, E, k, act, bias, saved.sched)
        assert launched_kernels[:n_fwd] == fwd, launched_kernels[:n_fwd]
        assert launched_kernels[n_fwd:] == bwd, launched_kernels[n_fwd:]
        results.append([y, dx, dw, grads.gate_up_proj, grads.down_proj, grads.gate_up_bias, grads.down_bias])
    names = ["y", "dx", "d_topk", "d_gate_up_proj", "d_down_proj", "d_gate_up_bias", "d_down_bias"]
    for n, a, b in zip(names, results[0], results[1]):
        if a is not None:
            assert torch.equal(_bits(a), _bits(b)), f"{n} not bitwise reproducible"

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
                                        (EDGE_T, 1, 9, "edge"), (8192, 8, 128, "random"), (4096, 8, 256, "skew"),
                                        (1000, 6, 512, "random")])
def test_schedule_kernel_equals_torch_schedule(lib, T, k, E, mode):
    from mok_nn import cuda_backend as cb

    ids, _ = _routing(T, k, E, mode, seed=T * k + E)
    want = cb.make_schedule_torch(ids, E)
    for _ in range(2):
        got = cb.make_schedule(ids, E)
        torch.cuda.synchronize()
        for name in ("pos", "row_token", "tile_expert", "seg_end", "seg_rows"):
            assert torch.equal(getattr(got, name), getattr(want, name)), name


ACT_KERNEL_CASES = [  # T, k, E, I, routing
    (333, 2, 8, 384, "skew"),
    (1, 1, 4, 128, "random"),
    (EDGE_T, 1, 9, 256, "edge"),
    (512, 8, 128, 768, "random"),
]


@pytest.mark.parametrize("act,limit", [("swiglu", None), ("swiglu", 7.0), ("swiglu_oai", 7.0), ("swiglu_oai", None)])
@pytest.mark.parametrize("case", ACT_KERNEL_CASES, ids=lambda c: "T{}k{}E{}I{}-{}".format(*c))
def test_act_kernels(lib, case, act, limit):
    """mok_act_fwd_<act> and mok_act_bwd_<act> (launched as act_forward / act_backward launch them) on every row
    of the used tiles (NaN-poisoned outputs): h, d gate_up, w*h and the per-row d topk-weight within bf16
    rounding of fp64 (h rounded to bf16 first, as the kernels multiply by the bf16 h), padding rows (w = 0)
    giving zero d gate_up and w*h, bitwise reproducible; the helpers give the same bits."""
    from mok_nn import cuda_backend as cb
    from mok_nn import reference

    T, k, E, I, mode = case
    ids, w = _routing(T, k, E, mode, seed=T + I)
    sched = cb.make_schedule(ids, E)
    m = sched.capacity
    g = torch.Generator(device="cuda").manual_seed(I)
    gate_up = (3 * torch.randn(m, 2 * I, device="cuda", generator=g)).to(torch.bfloat16)  # past the limit too
    dh = torch.randn(m, I, device="cuda", generator=g)
    w_rows = cb.row_weights(sched, w)
    live = (sched.tile_expert >= 0).repeat_interleave(registry.TILE_M)
    lim = float("inf") if limit is None else limit
    runs = []
    for _ in range(2):
        h = torch.full((m, I), float("nan"), device="cuda", dtype=torch.bfloat16)
        dgu = torch.full_like(gate_up, float("nan"))
        wh = torch.full((m, I), float("nan"), device="cuda", dtype=torch.bfloat16)
        dw = torch.full((m,), float("nan"), device="cuda")
        lib.launch(f"mok_act_fwd_{act}", gate_up, h, sched.tile_expert, lim, stream=_stream())
        lib.launch(f"mok_act_bwd_{act}", gate_up, dh, w_rows, dgu, wh, dw, sched.tile_expert, lim, 0,
                   stream=_stream())
        torch.cuda.synchronize()
        runs.append([t[live] for t in (h, dgu, wh, dw)])
    for n, a, b in zip(("h", "d gate_up", "w*h", "dw"), *runs):
        assert not torch.isnan(a).any(), f"{n}: rows left unwritten"
        assert torch.equal(_bits(a), _bits(b)), f"{n} not bitwise reproducible"
    h, dgu, wh, dw = runs[0]
    gu64, dh64, w64 = gate_up[live].double(), dh[live].double(), w_rows[live].double()[:, None]
    h64 = reference.activation_forward(gu64, act, limit)
    assert rel_l2(h, h64) < BF16_TOL
    hb = h64.to(torch.bfloat16).double()
    assert rel_l2(dw, (dh64 * hb).sum(dim=1)) < BF16_TOL
    pos = sched.pos.reshape(-1)
    real = torch.zeros(m, dtype=torch.bool, device="cuda")
    real[pos] = True
    real = real[live]
    assert rel_l2(wh[real], (w64 * hb)[real]) < BF16_TOL
    assert rel_l2(dgu[real], reference.activation_backward(gu64, w64 * dh64, act, limit)[real]) < BF16_TOL
    assert torch.all(dgu[~real] == 0) and torch.all(wh[~real] == 0), "padding rows: w = 0"
    # the helpers
    assert torch.equal(_bits(cb.act_forward(gate_up, sched, act, limit)[live]), _bits(h))
    dgu2, wh2, dw2 = cb.act_backward(gate_up, dh, w_rows, sched, act, limit)
    for a, b in ((dgu2, dgu), (wh2, wh), (dw2, dw)):
        assert torch.equal(_bits(a[live]), _bits(b))
    # mx = 1: d gate_up's MXFP8 values along its columns (the slow quantiser on the bf16 d gate_up; the other
    # outputs the same), also in place and by the helper
    from mok_nn.mxfp8 import fake_quantize

    want = fake_quantize(dgu, -1)
    assert not torch.equal(want, dgu)
    for in_place in (False, True):
        gu = gate_up.clone()
        dgu_mx, wh_mx, dw_mx = cb.act_backward(gu, dh, w_rows, sched, act, limit, in_place=in_place, mx=True)
        assert (dgu_mx.data_ptr() == gu.data_ptr()) == in_place
        for a, b in ((dgu_mx, want), (wh_mx, wh), (dw_mx, dw)):
            assert torch.equal(_bits(a[live]), _bits(b))


GATE_UP_ACT_KERNELS = ("mok_gemm_gate_up_swiglu_ppc", "mok_gemm_gate_up_swiglu_ef")
ACT_CASES = [  # T, k, E, H, I, routing, limit (SwiGLU: the one activation of the fused gate/up kernels)
    (256, 2, 8, 256, 128, "random", None),
    (333, 2, 8, 320, 384, "skew", 7.0),  # three h tiles, empty experts
    (300, 1, 3, 128, 256, "one_expert", 7.0),
    (1, 1, 4, 256, 128, "random", None),
    (EDGE_T, 1, 9, 256, 256, "edge", None),
    (512, 8, 128, 2048, 768, "random", None),  # qwen3-30b-a3b, reduced T
    (96, 2, 8, 4096, 14336, "random", None),  # mixtral-8x7b: 56 h tiles (raster bands of 8 rows)
]


def test_gate_up_act_kernels_listed():
    from mok_nn import cuda_backend as cb

    assert {s.name for s in registry.SPECS if s.factory == "VarlenMGroupedGemmAct"} == set(GATE_UP_ACT_KERNELS)
    assert cb.FUSED_ACT_ACTIVATIONS == ("swiglu",)


@pytest.mark.parametrize("case", ACT_CASES, ids=lambda c: "T{}k{}E{}H{}I{}-{}-{}".format(*c))
@pytest.mark.parametrize("name", GATE_UP_ACT_KERNELS)
@pytest.mark.parametrize("raster", ["rule", "columns"])  # gemm_group_m's raster, or column tiles fastest (1)
def test_gate_up_act_fused(lib, case, name, raster):
    """mok_gemm_gate_up_swiglu_ppc / _ef into NaN-poisoned outputs: gate_up and h of every used row within bf16
    rounding of fp64, bitwise reproducible, and bitwise what the plain GEMM (the form gemm_kernel picks for
    K = H) + mok_act_fwd_swiglu give: where gate_up_act runs these kernels (use_fused_act) it changes no bits."""
    from mok_nn import cuda_backend as cb
    from mok_nn import reference

    T, k, E, H, I, mode, limit = case
    ids, _ = _routing(T, k, E, mode, seed=T + I)
    sched = cb.make_schedule(ids, E)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    a = cb.gather_rows(x, sched)
    W13 = (torch.randn(E, 2 * I, H, device="cuda") / H**0.5).to(torch.bfloat16)
    used = int(sched.seg_end[-1])
    group_m = cb.gemm_group_m(2 * I, registry.tile_n_of(name)) if raster == "rule" else 1
    outs = []
    for h_mx in (0, 0, 1):
        gu = torch.full((a.shape[0], 2 * I), float("nan"), device="cuda", dtype=torch.bfloat16)
        h = torch.full((a.shape[0], I), float("nan"), device="cuda", dtype=torch.bfloat16)
        lib.launch(name, a.unsqueeze(-1), W13.permute(1, 2, 0), gu.unsqueeze(-1), h.unsqueeze(-1),
                   sched.tile_expert, sched.seg_end, sched.seg_rows_for(name), h_mx,
                   float("inf") if limit is None else limit, group_m, stream=_stream())
        torch.cuda.synchronize()
        outs.append((gu[:used], h[:used]))
    gu_mx, h_mx_out = outs.pop()
    for a_, b_ in zip(*outs):
        assert not torch.isnan(a_).any(), "rows left unwritten"
        assert torch.equal(_bits(a_), _bits(b_)), "not bitwise reproducible"
    gu, h = outs[0]
    pos = sched.pos.reshape(-1)
    assert rel_l2(gu[pos], slot_products(x, ids, W13, False)) < BF16_TOL
    assert rel_l2(h[pos], reference.activation_forward(gu[pos].double(), "swiglu", limit)) < BF16_TOL
    gu_ref = cb.grouped_gemm(a, W13, sched, transpose_w=False)
    h_ref = cb.act_forward(gu_ref, sched, "swiglu", limit)
    assert torch.equal(gu, gu_ref[:used]), "gate_up differs from the plain GEMM"
    assert torch.equal(h, h_ref[:used]), "h differs from mok_act_fwd_swiglu"
    # h_mx: the helper-warp kernel (_ef) stores h's MXFP8 values along I, bitwise mok_mx_quant's; _ppc ignores it
    assert torch.equal(_bits(gu_mx), _bits(gu))
    h_q = cb.mx_values(h_ref, cb.MX_ALONG_COLS)[:used]
    assert torch.equal(_bits(h_mx_out), _bits(h_q if name.endswith("_ef") else h))
    assert not name.endswith("_ef") or not torch.equal(h_q, h)  # (the values are not h itself)
    if raster == "rule" and name.endswith("_ppc" if cb.pingpong("act", H) else "_ef"):
        gu_p, h_p = cb.gate_up_act(a, W13, sched, "swiglu", limit)  # the helper runs this kernel for this H
        assert torch.equal(_bits(gu_p[:used]), _bits(gu)) and torch.equal(_bits(h_p[:used]), _bits(h))
        _, h_p = cb.gate_up_act(a, W13, sched, "swiglu", limit, h_mx=True)  # by the kernel or by mx_values
        assert torch.equal(_bits(h_p[:used]), _bits(h_q))


DACT_CASES = [  # T, k, E, H, I, routing, activation, limit
    (256, 2, 8, 256, 256, "random", "swiglu", None),
    (333, 2, 8, 320, 512, "skew", "swiglu", 7.0),  # two column tiles, empty experts, clamps active
    (300, 1, 3, 128, 256, "one_expert", "swiglu_oai", 7.0),
    (1, 1, 4, 256, 256, "random", "swiglu_oai", None),
    (EDGE_T, 1, 9, 256, 256, "edge", "swiglu", None),  # tiles of <= 64 routed rows: one 64-row MMA block
    (512, 8, 128, 2048, 768, "random", "swiglu", None),  # qwen3-30b-a3b, reduced T: 3 column tiles
    (96, 2, 8, 4096, 14336, "random", "swiglu", None),  # mixtral-8x7b: 56 column tiles (raster bands)
]


@pytest.mark.parametrize("case", DACT_CASES, ids=lambda c: "T{}k{}E{}H{}I{}-{}-{}-{}".format(*c))
@pytest.mark.parametrize("raster", ["rule", "columns"])  # gemm_group_m's raster, or column tiles fastest (1)
def test_dgrad_act_fused(lib, case, raster):
    """mok_gemm_dact_<act>_ppc (given the routed rows as seg_rows, as Schedule.seg_rows_for gives them): d gate_up
    and w*h bitwise what mok_gemm_bn_f32_dyn + mok_act_bwd_<act> give, the per-row d topk-weight close to
    theirs; all three within bf16 rounding of an fp64 oracle; all outputs poisoned, run twice; cb.dgrad_act
    gives the same bits."""
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
    name = f"mok_gemm_dact_{act}_ppc"
    tile_n = registry.tile_n_of(name)
    group_m = cb.gemm_group_m(I, tile_n) if raster == "rule" else 1
    runs = []
    for _ in range(2):
        dgu = torch.full_like(gate_up, float("nan"))
        wh = torch.full((m, I), float("nan"), device="cuda", dtype=torch.bfloat16)
        parts = torch.full((I // tile_n, m), float("nan"), device="cuda")
        lib.launch(
            name, dy_rows.unsqueeze(-1), W2.permute(2, 1, 0), dgu.unsqueeze(-1), wh.unsqueeze(-1),
            gate_up.unsqueeze(-1), w_rows, parts, sched.tile_expert, sched.seg_end, sched.seg_rows_for(name),
            float("inf") if limit is None else limit, group_m, stream=_stream(),
        )  # fmt: skip
        torch.cuda.synchronize()
        runs.append((dgu[:used], wh[:used], parts[:, :used]))
    for a, b in zip(runs[0], runs[1]):
        assert not torch.isnan(a).any(), "outputs left unwritten"
        assert torch.equal(_bits(a), _bits(b)), "not bitwise reproducible"
    dgu, wh, parts = runs[0]
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
    assert rel_l2(dw[pos], (dh64 * h64).sum(dim=1)) < BF16_TOL
    assert rel_l2(wh[pos], w64 * h64) < BF16_TOL
    assert rel_l2(dgu[pos], reference.activation_backward(gu64, w64 * dh64, act, limit)) < BF16_TOL
    if raster == "rule":
        dgu_p, wh_p, dw_p = cb.dgrad_act(dy_rows, W2, gate_up, w_rows, sched, act, limit)
        assert torch.equal(_bits(dgu_p[:used]), _bits(dgu)) and torch.equal(_bits(wh_p[:used]), _bits(wh))
        assert torch.equal(_bits(dw_p[:used]), _bits(dw))
        # in place (the layer's backward where autograd keeps no graph): d gate_up over gate_up, the same bits
        for run in (lambda gu: cb.dgrad_act(dy_rows, W2, gu, w_rows, sched, act, limit, in_place=True),
                    lambda gu: cb.act_backward(gu, dh, w_rows, sched, act, limit, in_place=True)):
            gu = gate_up.clone()
            dgu_i, wh_i, _ = run(gu)
            torch.cuda.synchronize()
            assert dgu_i.data_ptr() == gu.data_ptr(), "d gate_up not written over gate_up"
            assert torch.equal(_bits(dgu_i[:used]), _bits(dgu)), "d gate_up in place differs"
            assert torch.equal(_bits(wh_i[:used]), _bits(wh)), "w*h with d gate_up in place differs"


@pytest.mark.parametrize("T,H,M", [(1, 8, 128), (333, 200, 1024), (4097, 2048, 9000), (64, 7168, 640)])
def test_gather_rows_kernel(lib, launched_kernels, T, H, M):
    """mok_gather_rows (take_rows without slots): row idx[r] of src, a zero row where idx[r] == T; the bits of
    index_select, every output row written (poisoned first, also by a grid of 3 CTAs), and the EP form (a
    zero last row in src)."""
    from mok_nn import cuda_backend as cb

    g = torch.Generator(device="cuda").manual_seed(T + H)
    src = torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16)
    idx = torch.randint(0, T + 1, (M,), device="cuda", generator=g)  # T: a padding row
    idx[: min(M, 3)] = T
    want = torch.cat([src, src.new_zeros(1, H)])[idx]
    launched_kernels.clear()
    got = cb.take_rows(src, idx)
    with_zero = torch.cat([src, src.new_zeros(1, H)])
    got_ep = cb.take_rows(with_zero, idx, has_zero_row=True)
    torch.cuda.synchronize()
    assert launched_kernels == ["mok_gather_rows"] * 2
    assert torch.equal(_bits(got), _bits(want))
    assert torch.equal(_bits(got_ep), _bits(want))
    poisoned = torch.full((M, H), float("nan"), device="cuda", dtype=torch.bfloat16)
    all_rows = torch.zeros(1, dtype=torch.int32, device="cuda")  # a tile table that skips no row
    cb._lib().launch("mok_gather_rows", src, idx, all_rows, poisoned, 3, stream=_stream())
    assert torch.equal(_bits(poisoned), _bits(want)), "a small grid (grid-stride) must write every row too"
    # a view at an odd element offset cannot be read in 16-byte vectors: the torch path, same rows
    flat = torch.cat([src.new_zeros(1), src.reshape(-1)])
    odd = flat[1:].view(T, H)
    assert odd.data_ptr() % 16 != 0
    launched_kernels.clear()
    assert torch.equal(cb.take_rows(odd, idx), want)
    assert launched_kernels == []


def _mx_test_rows(T, H, seed):
    """bf16 rows [T, H] of mixed magnitudes with special 32-column blocks: all zero, one NaN, one inf, values at
    E4M3's largest (448 times a power of two), bf16 subnormals, and a block whose amax rounds its scale up."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    src = torch.randn(T, H, device="cuda", generator=g) * torch.exp2(torch.randint(-20, 20, (T, 1), device="cuda",
                                                                                   generator=g).float())
    src = src.to(torch.bfloat16)
    blocks = H // 32
    specials = [(0, lambda b: b.zero_()), (1, lambda b: b.__setitem__(5, float("nan"))),
                (2, lambda b: b.__setitem__(31, float("-inf"))), (3, lambda b: b.__setitem__(7, 448.0 * 2**20)),
                (4, lambda b: b.copy_(torch.full_like(b, 3e-39))), (5, lambda b: b.__setitem__(0, 1.875 * 2**-3))]
    for i, (j, make) in enumerate(specials):
        r = i % T
        make(src[r, (j % blocks) * 32:(j % blocks) * 32 + 32])
    return src


@pytest.mark.parametrize("T,H,k,E,mode", [(1, 32, 1, 4, "uniform"), (333, 224, 4, 16, "uniform"),
                                          (4097, 2048, 8, 128, "uniform"), (64, 7168, 8, 256, "uniform"),
                                          (300, 8224, 6, 32, "skew")])
def test_scatter_rows_mx_values(lib, launched_kernels, T, H, k, E, mode):
    """gather_rows(mx=True): mok_scatter_rows stores each source row's MXFP8 values along H (its mx argument),
    bit for bit the rows of mx_values(src) (mok_mx_quant) and equal to mxfp8.fake_quantize's (NaN blocks alike),
    with zero padding rows; rows widths over one, several and a partial step of the warp's 16-byte lanes; a grid
    of 3 CTAs; skip_tail; and the schedule's call (make_schedule(gather_x, gather_mx=True)) the same rows."""
    from mok_nn import cuda_backend as cb
    from mok_nn.mxfp8 import fake_quantize

    ids, _ = _routing(T, k, E, mode, seed=T + H + 1)
    sched = cb.make_schedule(ids, E)
    src = _mx_test_rows(T, H, seed=T * H + 1)
    values = cb.mx_values(src, cb.MX_ALONG_COLS)
    torch.testing.assert_close(values.float(), fake_quantize(src, -1).float(), rtol=0, atol=0, equal_nan=True)
    want = torch.cat([values, values.new_zeros(1, H)])[sched.row_token]
    launched_kernels.clear()
    got = cb.gather_rows(src, sched, mx=True)
    torch.cuda.synchronize()
    assert launched_kernels == ["mok_scatter_rows"]
    assert torch.equal(_bits(got), _bits(want))
    poisoned = torch.full_like(want, float("nan"))
    all_rows = torch.zeros(1, dtype=torch.int32, device="cuda")
    cb._lib().launch("mok_scatter_rows", src, sched.pos.contiguous(), sched.row_token, all_rows, poisoned, 1, 3,
                     stream=_stream())
    assert torch.equal(_bits(poisoned), _bits(want)), "grid of 3"
    tail = (sched.tile_expert < 0).repeat_interleave(registry.TILE_M)
    assert torch.equal(_bits(cb.gather_rows(src, sched, skip_tail=True, mx=True)[~tail]), _bits(want[~tail]))
    launched_kernels.clear()
    fused = cb.make_schedule(ids, E, gather_x=src, gather_mx=True)
    assert launched_kernels == ["mok_schedule_gather"]
    assert fused.take_gathered(src, "bf16") is None  # its rows are the MXFP8 values, not src's
    fused = cb.make_schedule(ids, E, gather_x=src, gather_mx=True)
    rows = fused.take_gathered(src, "mxfp8")
    assert torch.equal(_bits(rows[~tail]), _bits(want[~tail]))
    # the same source twice: the same bits (one warp per source row, no order between warps to matter)
    assert torch.equal(_bits(cb.gather_rows(src, sched, mx=True)), _bits(got))


@pytest.mark.parametrize("T,H,k,E,mode", [(1, 8, 1, 4, "uniform"), (333, 200, 4, 16, "uniform"),
                                          (4097, 2048, 8, 128, "uniform"), (64, 7168, 8, 256, "uniform"),
                                          (500, 1024, 2, 8, "one_expert"), (300, 384, 6, 32, "skew"),
                                          (EDGE_T, 256, 1, 9, "edge")])
def test_scatter_rows_kernel(lib, launched_kernels, T, H, k, E, mode):
    """mok_scatter_rows (gather_rows: take_rows with the schedule's slots): from the source side, the rows of
    a real schedule, the bits of index_select with a zero row (every row poisoned first, also with a grid of 3
    CTAs); with the schedule's tile table (skip_tail, both gather kernels) the rows past the last segment
    untouched; and the EP form: a source with a zero row last, slots naming another source's row or a row
    past a capacity cut (not written by that source), padding rows naming the zero row or anything out of
    range."""
    from mok_nn import cuda_backend as cb

    ids, _ = _routing(T, k, E, mode, seed=T + H)
    sched = cb.make_schedule(ids, E)
    g = torch.Generator(device="cuda").manual_seed(T * H)
    src = torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16)
    want = torch.cat([src, src.new_zeros(1, H)])[sched.row_token]
    launched_kernels.clear()
    got = cb.gather_rows(src, sched)
    torch.cuda.synchronize()
    assert launched_kernels == ["mok_scatter_rows"]
    assert torch.equal(_bits(got), _bits(want))
    # a column block of src (the gate/up weight gradient's x rows: a view with src's row stride)
    c0, c1 = 8 * (H // 16), H - 8 * (H // 32)
    if c1 > c0:
        launched_kernels.clear()
        block = cb.gather_rows(src[:, c0:c1], sched)
        torch.cuda.synchronize()
        assert launched_kernels == ["mok_scatter_rows"]
        assert torch.equal(_bits(block), _bits(want[:, c0:c1])), "column block"
    stream = _stream()
    poisoned = torch.full_like(want, float("nan"))
    all_rows = torch.zeros(1, dtype=torch.int32, device="cuda")  # a tile table that skips no row
    cb._lib().launch("mok_scatter_rows", src, sched.pos.contiguous(), sched.row_token, all_rows, poisoned, 0, 3,
                     stream=stream)
    assert torch.equal(_bits(poisoned), _bits(want)), "a small grid (grid-stride) must write every row too"
    # skip_tail: the rows of tiles past the last segment stay as they were (poison), the others as before
    tail = (sched.tile_expert < 0).repeat_interleave(registry.TILE_M)
    got = cb.gather_rows(src, sched, skip_tail=True)
    assert torch.equal(got[~tail], want[~tail])
    for name, args, mx in (("mok_scatter_rows", (src, sched.pos, sched.row_token), (0,)),
                           ("mok_gather_rows", (src, sched.row_token), ())):
        probe = torch.full_like(want, float("nan"))
        cb._lib().launch(name, *args, sched.tile_expert, probe, *mx, 3, stream=stream)
        assert torch.equal(_bits(probe[~tail]), _bits(want[~tail])), name
        assert probe[tail].isnan().all(), f"{name}: a row past the last segment was written"
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
        cb._lib().launch("mok_scatter_rows", with_zero, slots, row_src, all_rows, out, 0, grid, stream=stream)
        assert torch.equal(_bits(out), _bits(want_ep)), grid
    assert torch.equal(cb.take_rows(with_zero, row_src, has_zero_row=True, slots=slots), want_ep)
    # the gather kernel on the same rows (its zero row: T)
    assert torch.equal(cb.take_rows(with_zero, torch.where((row_src >= 0) & (row_src < T), row_src, T),
                                    has_zero_row=True), want_ep)


@pytest.mark.parametrize("P,tc,H,k,E", [(2, 333, 200, 4, 16), (2, 4096, 2048, 8, 128), (3, 64, 7168, 8, 24),
                                        (4, 1, 8, 1, 4)])
def test_scatter_rows_peers_kernel(lib, P, tc, H, k, E):
    """mok_scatter_rows_peers (the EP pull): P sections on this GPU stand for the ranks' sections, each
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
