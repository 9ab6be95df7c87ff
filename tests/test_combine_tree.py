"""The combine's fixed tree over expert groups (kernels/combine.py), on the CPU: its order, its
torch stand-in against an fp64 oracle, and when the EP path may pre-reduce per rank."""

import pytest
import torch

from mok_nn import cuda_backend as cb
from mok_nn import cuda_ep
from mok_nn.kernels.registry import combine_leaves


def test_leaves_divide_the_experts():
    assert [combine_leaves(e) for e in (1, 2, 6, 8, 12, 128, 256, 257)] == [1, 2, 2, 8, 4, 8, 8, 1]
    assert cb.experts_per_leaf(256) == 32 and cb.experts_per_leaf(8) == 1 and cb.experts_per_leaf(6) == 3


def test_tree_order_not_slot_order():
    """Values where the order shows in fp32: by leaf 1e8, -1e8, 1, 1, so the tree over leaves 0..3
    gives (1e8 + -1e8) + (1 + 1) = 2, while the slot order j = 0..3 (leaves 3, 0, 2, 1) gives
    ((1 + 1e8) + 1) + -1e8 = 0 (1e8 + 1 rounds to 1e8)."""
    E = 8  # one expert per leaf
    ids = torch.tensor([[3, 0, 2, 1]])
    vals = {0: 1e8, 1: -1e8, 2: 1.0, 3: 1.0}  # by leaf: tree ((1e8 + -1e8) + (1 + 1)) = 2
    rows = torch.tensor([[vals[int(e)]] * 8 for e in ids[0]], dtype=torch.float32)
    pos = torch.arange(4).view(1, 4)
    w = torch.ones(1, 4)
    got = cb.combine_torch(rows, pos, w, ids, E, torch.float32)
    assert got[0, 0].item() == 2.0
    # the slot order, in fp32 by hand
    s = torch.tensor(0.0)
    for j in range(4):
        s = s + rows[j, 0]
    assert s.item() == 0.0


def test_empty_leaves_are_skipped_not_added():
    """A node with one present child is that child: a present leaf of -0.0 reaches the root as -0.0
    (adding the empty siblings' +0.0 would give +0.0), and empty leaves' contents are never read."""
    vals = [torch.full((2, 4), float("nan")) for _ in range(8)]
    present = [torch.zeros(2, dtype=torch.bool) for _ in range(8)]
    vals[5] = torch.tensor([[-0.0] * 4, [3.0] * 4])
    present[5] = torch.tensor([True, True])
    vals[2] = torch.tensor([[7.0] * 4, [float("nan")] * 4])
    present[2] = torch.tensor([True, False])
    root, any_ = cb.tree_sum_torch(vals, present)
    assert any_.all()
    assert root[0].tolist() == [7.0] * 4 and root[1].tolist() == [3.0] * 4
    vals[2] = torch.full((2, 4), float("nan"))
    present[2] = torch.zeros(2, dtype=torch.bool)
    root, _ = cb.tree_sum_torch(vals, present)
    assert torch.signbit(root[0]).all() and root[1].tolist() == [3.0] * 4


@pytest.mark.parametrize("E,k", [(8, 2), (6, 3), (256, 8), (12, 4)])
def test_combine_torch_vs_fp64(E, k):
    g = torch.Generator().manual_seed(E * 10 + k)
    T, H = 37, 24
    rows = torch.randn(T * k + 3, H, generator=g).bfloat16()
    pos = torch.randperm(T * k + 3, generator=g)[:T * k].view(T, k)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    w = torch.rand(T, k, generator=g)
    got = cb.combine_torch(rows, pos, w, ids, E, torch.float32)
    want = (rows.double()[pos] * w.double()[..., None]).sum(1)
    assert ((got.double() - want).norm() / want.norm()).item() < 1e-6


def test_combine_sums_rule():
    """Per-rank partial sums where they cross NVLink in fewer bytes than one row per slot (or the bytes are
    hidden) and the ranks divide the combine tree's leaves, else one row per slot."""
    assert cuda_ep.combine_sums(256, 2, 8) == "rank"  # auto: 4 slots per rank and token on average
    assert cuda_ep.combine_sums(128, 2, 8) == "rank"
    assert cuda_ep.combine_sums(8, 2, 2) == "slot"  # mixtral: 1 slot per rank
    assert cuda_ep.combine_sums(256, 2, 4) == "slot"  # 2 per rank: not fewer bytes
    assert cuda_ep.combine_sums(256, 8, 8) == "slot"
    assert cuda_ep.combine_sums(8, 2, 2, hidden=True) == "rank"  # d x by the copy engines: bytes hidden
    assert cuda_ep.combine_sums(6, 3, 2, hidden=True) == "slot"  # 3 ranks do not divide 2 leaves
    assert cuda_ep.combine_sums(12, 8, 8) == "slot"  # 8 ranks do not divide gcd(12, 8) = 4 leaves


def test_combine_refuses_more_than_32_slots():
    rows = torch.zeros(40, 8, dtype=torch.bfloat16)
    pos = torch.arange(33).view(1, 33)
    with pytest.raises(ValueError, match="at most 32"):
        cb.combine(rows, pos, torch.ones(1, 33), torch.zeros(1, 33, dtype=torch.long), 8, torch.bfloat16)
