"""The GPU schedule is plain torch ops: check its invariants on the CPU."""

import pytest
import torch

from mok_nn.cuda_backend import TILE_M, make_schedule, row_weights, schedule_capacity, schedule_chunk
from mok_nn.kernels.registry import SCHEDULE_MC_MAX_CHUNKS, SCHEDULE_MC_WARPS


def _routing(num_tokens, top_k, num_experts, gen, skew=False):
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    if skew:  # leave some experts empty, crowd others
        logits[:, : num_experts // 2] -= 20
    ids = torch.topk(logits, top_k, dim=1).indices
    w = torch.rand(num_tokens, top_k, generator=gen)
    return ids, w


@pytest.mark.parametrize("num_tokens,top_k,num_experts,skew", [(1, 1, 4, False), (37, 2, 8, True), (300, 4, 16, False)])
def test_schedule_invariants(num_tokens, top_k, num_experts, skew):
    gen = torch.Generator().manual_seed(num_tokens)
    ids, w = _routing(num_tokens, top_k, num_experts, gen, skew)
    s = make_schedule(ids, num_experts)
    cap = schedule_capacity(num_tokens, top_k, num_experts)
    assert s.capacity == cap and cap % TILE_M == 0
    pos = s.pos.reshape(-1)
    assert pos.unique().numel() == pos.numel()  # each slot has its own row
    # each slot's row holds its token, weight, and lies in its expert's tiles
    tokens = torch.arange(num_tokens).repeat_interleave(top_k)
    assert torch.equal(s.row_token[pos], tokens)
    rw = row_weights(s, w)
    assert torch.equal(rw[pos], w.reshape(-1))
    assert torch.equal(s.tile_expert[pos // TILE_M].long(), ids.reshape(-1))
    assert torch.equal(s.expert_of_rows()[pos], ids.reshape(-1))
    # padding rows point at the zero row and carry no weight
    pad = torch.ones(cap, dtype=torch.bool)
    pad[pos] = False
    assert torch.all(s.row_token[pad] == num_tokens) and torch.all(rw[pad] == 0)
    # rows of an expert keep token order (stable), segments are tile aligned
    counts = torch.bincount(ids.reshape(-1), minlength=num_experts)
    ends = torch.cumsum((counts + TILE_M - 1) // TILE_M * TILE_M, 0)
    assert torch.equal(s.seg_end.long(), ends)
    assert s.seg_rows.dtype == torch.int32 and torch.equal(s.seg_rows.long(), counts)  # real rows per expert
    for e in range(num_experts):
        rows = pos[ids.reshape(-1) == e]
        assert torch.all(rows[1:] > rows[:-1])
    used_tiles = int(ends[-1]) // TILE_M
    assert torch.all(s.tile_expert[used_tiles:] == -1)


@pytest.mark.parametrize("num_slots", [0, 1, 511, 512, 513, 16384, 65536, 65537, 200_000, 2_000_003])
def test_schedule_chunk_covers_slots(num_slots):
    # the multi-CTA schedule's chunks: whole warps of 32 slots, at most MAX_CHUNKS, covering every slot once
    chunk, chunks = schedule_chunk(num_slots)
    assert chunk % (SCHEDULE_MC_WARPS * 32) == 0 and 1 <= chunks <= SCHEDULE_MC_MAX_CHUNKS
    assert chunks * chunk >= num_slots and (chunks - 1) * chunk < max(num_slots, 1)


def test_gemm_seg_rows_padded():
    """The GEMMs get the padded segment sizes as seg_rows: no tile's rows count as padding."""
    from mok_nn.cuda_backend import padded_seg_rows

    gen = torch.Generator().manual_seed(3)
    ids, _ = _routing(50, 2, 8, gen, skew=True)
    s = make_schedule(ids, 8)
    assert not torch.equal(s.seg_rows, padded_seg_rows(s.seg_end))  # some expert's last tile is part padding
    pad = padded_seg_rows(s.seg_end)
    assert torch.equal(s.gemm_seg_rows(), pad) and pad.dtype == torch.int32
    assert torch.equal(pad.long(), (s.seg_rows.long() + TILE_M - 1) // TILE_M * TILE_M)


def test_schedule_larger_capacity():
    """A given capacity above the worst case only appends padding rows (token T, tile expert -1);
    one below it, or off the tile, is refused."""
    gen = torch.Generator().manual_seed(2)
    ids, _ = _routing(37, 2, 8, gen, skew=True)
    base = make_schedule(ids, 8)
    cap = base.capacity + 3 * TILE_M
    big = make_schedule(ids, 8, cap)
    assert big.capacity == cap and big.tile_expert.numel() == cap // TILE_M
    for name in ("pos", "seg_end", "seg_rows"):
        assert torch.equal(getattr(big, name), getattr(base, name))
    assert torch.equal(big.row_token[:base.capacity], base.row_token)
    assert bool((big.row_token[base.capacity:] == 37).all())
    assert torch.equal(big.tile_expert[:base.tile_expert.numel()], base.tile_expert)
    assert bool((big.tile_expert[base.tile_expert.numel():] == -1).all())
    for bad in (base.capacity - TILE_M, base.capacity + 1):
        with pytest.raises(ValueError, match="capacity"):
            make_schedule(ids, 8, bad)


def test_take_gathered_gives_the_rows_of_that_very_x_once():
    from mok_nn import cuda_backend as cb

    ids = torch.randint(0, 4, (10, 2), generator=torch.Generator().manual_seed(3))
    s = cb.make_schedule_torch(ids, 4)
    assert s.gathered is None and s.take_gathered(torch.zeros(1)) is None  # the torch schedule gathers nothing
    x = torch.randn(10, 8)
    rows = cb.gather_rows(x, s)
    s.gathered = (x, rows, "bf16")
    assert s.take_gathered(x.clone()) is None and s.gathered is None  # equal values, another tensor: not taken
    s.gathered = (x, rows, "bf16")
    assert s.take_gathered(x, "mxfp8") is None and s.gathered is None  # x's rows, not its MXFP8 values
    s.gathered = (x, rows, "bf16")
    assert s.take_gathered(x) is rows and s.gathered is None and s.take_gathered(x) is None


def test_gather_rows_of_mxfp8_values():
    """gather_rows(mx=True) off the GPU kernel (here: index_select): the rows of x's MXFP8 values along H, i.e. of
    mxfp8.fake_quantize(x, -1), a NaN block included, with zero padding rows; a width that is not whole blocks of 32
    is refused as mx_values refuses it."""
    from mok_nn import cuda_backend as cb
    from mok_nn.mxfp8 import fake_quantize

    g = torch.Generator().manual_seed(11)
    ids = torch.randint(0, 4, (40, 2), generator=g)
    s = cb.make_schedule_torch(ids, 4)
    x = (torch.randn(40, 96, generator=g) * 2.0 ** torch.randint(-9, 9, (40, 1), generator=g)).to(torch.bfloat16)
    x[3, 33] = float("nan")
    values = fake_quantize(x, -1)
    assert not torch.equal(values, x)  # (the quantisation changes x: the test can tell the two apart)
    want = torch.cat([values, values.new_zeros(1, 96)])[s.row_token]
    got = cb.gather_rows(x, s, mx=True)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    assert got[s.row_token == 3][:, 32:64].isnan().all()  # the NaN's block, in each of token 3's rows
    with pytest.raises(ValueError, match="blocks of 32"):
        cb.gather_rows(x[:, :80], s, mx=True)


def test_seg_rows_for_by_kernel():
    """The clustered ping-pong kernels (their half tiles) and the dynamic-tile kernels (their skipped warp groups)
    get the routed rows; every other kernel the padded sizes, so none of its warp groups skips its MMA."""
    from mok_nn.kernels.registry import GEMM_DYN_KERNELS, SPECS_BY_NAME

    ids, _ = _routing(300, 2, 8, torch.Generator().manual_seed(3))
    s = make_schedule(ids, 8)
    padded = s.gemm_seg_rows()
    assert not torch.equal(s.seg_rows, padded)  # some expert's last tile is not full
    routed = [n for n in SPECS_BY_NAME if n.endswith("_ppc")] + list(GEMM_DYN_KERNELS)
    assert "mok_gemm_dact_swiglu_ppc" in routed and "mok_gemm_bk_ef_dyn" in routed
    for name in routed:
        assert s.seg_rows_for(name) is s.seg_rows, name
    for name in ("mok_gemm_bk", "mok_gemm_bn", "mok_gemm_gate_up_swiglu_ef", "mok_gemm_bk_ef_push"):
        assert s.seg_rows_for(name) is padded, name


def test_dynamic_tile_kernels():
    """The _dyn kernels take the plain GEMM's arguments and the tile counter the launch zeroes."""
    from mok_nn.kernels.registry import GEMM_DYN_KERNELS, SPECS_BY_NAME

    assert set(GEMM_DYN_KERNELS) == {"mok_gemm_bk_ef_dyn", "mok_gemm_bn_ef_dyn", "mok_gemm_bn_f32_dyn"}
    plain = [a.name for a in SPECS_BY_NAME["mok_gemm_bk"].args]
    for n in GEMM_DYN_KERNELS:
        assert [a.name for a in SPECS_BY_NAME[n].args] == plain + ["tile_counter"]


def test_gemm_raster():
    """Expert bands (group_m 0) where band_rule would run column tiles fastest, else its bands of 8 row tiles
    past 32 column tiles; the weight gradients' raster has no expert bands."""
    from mok_nn import cuda_backend as cb

    assert cb.gemm_group_m(4096) == 0 and cb.gemm_group_m(28672) == 8 and cb.gemm_group_m(8192, 128) == 8
    assert cb.wgrad_group_m("mok_gemm_wgrad_defer_c2", 28672) == 8
    assert cb.wgrad_group_m("mok_gemm_wgrad_defer_c2", 4096) == 1


@pytest.mark.parametrize("slots,cap,experts,scratch", [(65536, 73728, 128, 4096), (3, 128, 5, 0), (1, 128, 1, 1)])
def test_schedule_buffers_layout(slots, cap, experts, scratch):
    """make_schedule's buffers, views of one allocation: the sizes and dtypes the kernels take, each on the
    alignment its kernel argument requires (registry), none overlapping another."""
    from mok_nn.cuda_backend import _schedule_buffers
    from mok_nn.kernels.registry import SPECS_BY_NAME

    bufs = _schedule_buffers(slots, cap, experts, scratch, torch.device("cpu"))
    want = [(torch.int64, slots), (torch.int64, cap), (torch.int32, cap // TILE_M), (torch.int32, experts),
            (torch.int32, experts), (torch.int32, experts), (torch.int32, scratch)]
    assert [(t.dtype, t.numel()) for t in bufs] == want
    assert all(t.dim() == 1 and t.is_contiguous() for t in bufs)
    spec = {a.name: a for a in SPECS_BY_NAME["mok_schedule_mc"].args}
    names = ("pos", "row_token", "tile_expert", "seg_end", "seg_rows", "padded_rows", "scratch")
    for name, t in zip(names, bufs):
        assert t.data_ptr() % spec[name].align == 0, name
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in bufs if t.numel())
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
    for t in bufs:  # written through one view, read back through it: no view aliases another
        t.fill_(7)
    bufs[0].fill_(-1)
    assert all(torch.all(t == 7) for t in bufs[1:])
