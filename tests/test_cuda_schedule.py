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


def test_schedule_setting_checked(monkeypatch):
    ids = torch.zeros(3, 2, dtype=torch.int64)
    monkeypatch.setenv("MOK_SCHEDULE", "single")  # a kernel name: on the CPU the torch schedule runs
    assert torch.equal(make_schedule(ids, 4).seg_rows, torch.tensor([6, 0, 0, 0], dtype=torch.int32))
    monkeypatch.setenv("MOK_SCHEDULE", "bogus")
    with pytest.raises(ValueError, match="MOK_SCHEDULE"):
        make_schedule(ids, 4)


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
    s.gathered = (x, rows)
    assert s.take_gathered(x.clone()) is None and s.gathered is None  # equal values, another tensor: not taken
    s.gathered = (x, rows)
    assert s.take_gathered(x) is rows and s.gathered is None and s.take_gathered(x) is None


def test_seg_rows_for_half_tiles(monkeypatch):
    """The ping-pong kernels get the routed rows (half tiles, MOK_GEMM_HALF_TILES=1, the default), every other
    kernel and the switch off the padded sizes; a bad setting is an error naming the variable."""
    ids, _ = _routing(300, 2, 8, torch.Generator().manual_seed(3))
    s = make_schedule(ids, 8)
    padded = s.gemm_seg_rows()
    assert not torch.equal(s.seg_rows, padded)  # some expert's last tile is not full
    monkeypatch.delenv("MOK_GEMM_HALF_TILES", raising=False)
    for name in ("mok_gemm_bk_ppc", "mok_gemm_bn_pp", "mok_gemm_gate_up_swiglu_ppc", "mok_gemm_dact_swiglu_ppc"):
        assert s.seg_rows_for(name) is s.seg_rows, name
    for name in ("mok_gemm_bk", "mok_gemm_bk_ef", "mok_gemm_gate_up_swiglu_ef", "mok_gemm_bk_ef_push"):
        assert s.seg_rows_for(name) is padded, name
    monkeypatch.setenv("MOK_GEMM_HALF_TILES", "0")
    assert s.seg_rows_for("mok_gemm_bk_ppc") is padded
    monkeypatch.setenv("MOK_GEMM_HALF_TILES", "yes")
    with pytest.raises(ValueError, match="MOK_GEMM_HALF_TILES"):
        s.seg_rows_for("mok_gemm_bk_ppc")


def test_gemm_tiles_switch(monkeypatch):
    """MOK_GEMM_TILES: static keeps every kernel; dynamic gives the cooperative kernels with a _dyn twin
    (mok_gemm_bk_ef, mok_gemm_bn_ef, mok_gemm_bn_f32) that twin and no other kernel one; auto (default) the
    twin for the kernels in DYNAMIC_TILES_AUTO; the _dyn kernels get the routed rows (their tail skip);
    a bad setting is an error naming the variable."""
    from mok_nn import cuda_backend as cb
    from mok_nn.kernels.registry import GEMM_DYN_KERNELS, SPECS_BY_NAME

    twins = ("mok_gemm_bk_ef", "mok_gemm_bn_ef", "mok_gemm_bn_f32")
    others = ("mok_gemm_bk", "mok_gemm_bn", "mok_gemm_bk_ppc", "mok_gemm_bn_pp", "mok_gemm_bk_ef_push")
    assert set(GEMM_DYN_KERNELS) == {n + "_dyn" for n in twins}
    for n in GEMM_DYN_KERNELS:  # the plain kernel's arguments + the counter
        assert [a.name for a in SPECS_BY_NAME[n].args] == [a.name for a in SPECS_BY_NAME[n[:-4]].args] + ["tile_counter"]
    monkeypatch.setenv("MOK_GEMM_TILES", "static")
    assert all(cb.gemm_tiles_suffix(n) == "" for n in twins + others)
    monkeypatch.setenv("MOK_GEMM_TILES", "dynamic")
    assert all(cb.gemm_tiles_suffix(n) == "_dyn" for n in twins)
    assert all(cb.gemm_tiles_suffix(n) == "" for n in others)
    monkeypatch.delenv("MOK_GEMM_TILES")
    assert [n for n in twins + others if cb.gemm_tiles_suffix(n)] == [n for n in twins if n in cb.DYNAMIC_TILES_AUTO]
    ids, _ = _routing(300, 2, 8, torch.Generator().manual_seed(4))
    s = make_schedule(ids, 8)
    assert all(s.seg_rows_for(n) is s.seg_rows for n in GEMM_DYN_KERNELS)
    monkeypatch.setenv("MOK_GEMM_TILES", "claimed")
    with pytest.raises(ValueError, match="MOK_GEMM_TILES"):
        cb.gemm_tiles_suffix("mok_gemm_bk_ef")


def test_gemm_raster_switch(monkeypatch):
    """MOK_GEMM_RASTER: bands keeps band_rule's bands (column tiles fastest, bands of 8 row tiles past 32
    column tiles), expert gives the kernels group_m 0 (a band per expert), auto (default) expert bands where
    band_rule says column tiles fastest; the weight gradients' raster ignores it (their kernels have no
    expert bands); a bad setting is an error naming the variable."""
    from mok_nn import cuda_backend as cb

    monkeypatch.delenv("MOK_GEMM_RASTER", raising=False)
    monkeypatch.delenv("MOK_WGRAD_GROUP_M", raising=False)
    assert cb.gemm_group_m(4096) == 0 and cb.gemm_group_m(28672) == 8 and cb.gemm_group_m(8192, 128) == 8
    monkeypatch.setenv("MOK_GEMM_RASTER", "bands")
    assert cb.gemm_group_m(4096) == 1 and cb.gemm_group_m(28672) == 8 and cb.gemm_group_m(8192, 128) == 8
    monkeypatch.setenv("MOK_GEMM_RASTER", "expert")
    assert cb.gemm_group_m(4096) == 0 and cb.gemm_group_m(28672) == 0
    assert cb.wgrad_group_m("mok_gemm_wgrad", 28672) == 8 and cb.wgrad_group_m("mok_gemm_wgrad", 4096) == 1
    monkeypatch.setenv("MOK_GEMM_RASTER", "rows")
    with pytest.raises(ValueError, match="MOK_GEMM_RASTER"):
        cb.gemm_group_m(4096)


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
