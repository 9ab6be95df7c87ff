"""The GPU schedule is plain torch ops: check its invariants on the CPU."""

import pytest
import torch

from mok_nn.cuda_backend import TILE_M, make_schedule, row_weights, schedule_capacity


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
    assert s.seg_rows.dtype == torch.int32 and torch.equal(s.seg_rows.long(), counts)
    for e in range(num_experts):
        rows = pos[ids.reshape(-1) == e]
        assert torch.all(rows[1:] > rows[:-1])
    used_tiles = int(ends[-1]) // TILE_M
    assert torch.all(s.tile_expert[used_tiles:] == -1)


def test_schedule_seg_rows_defaults():
    """Without seg_rows the GEMMs get the padded segment sizes (nothing skipped); a caller
    passing row_expert fifth (written before seg_rows existed) still sets row_expert."""
    from mok_nn.cuda_backend import Schedule, padded_seg_rows

    gen = torch.Generator().manual_seed(3)
    ids, _ = _routing(50, 2, 8, gen, skew=True)
    s = make_schedule(ids, 8)
    old = Schedule(s.pos, s.row_token, s.tile_expert, s.seg_end, s.expert_of_rows())
    assert old.seg_rows is None and torch.equal(old.row_expert, s.expert_of_rows())
    pad = padded_seg_rows(s.seg_end)
    assert torch.equal(old.gemm_seg_rows(), pad) and pad.dtype == torch.int32
    assert torch.equal(pad.long(), (s.seg_rows.long() + TILE_M - 1) // TILE_M * TILE_M)
    assert torch.equal(s.gemm_seg_rows(), s.seg_rows)
