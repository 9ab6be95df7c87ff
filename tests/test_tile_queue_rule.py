"""The join rule of the dynamic dispatch-pair GEMM (tile_queue.first_guarded_cta, used by
grouped_gemm._may_join), on the CPU: every tile is claimed exactly once whatever the guarded CTAs
decide, and the CTAs that may spin leave the dispatch its SMs."""

import pytest

pytest.importorskip("cutlass")

from mok_nn import cuda_ep  # noqa: E402
from mok_nn.kernels.registry import TILE_M  # noqa: E402
from mok_nn.kernels.tile_queue import first_guarded_cta  # noqa: E402


def _claims(tiles, grid, comm, guard_passes):
    """Model of one launch: CTA b joins if b < first_guarded_cta or guard_passes(b); joined CTAs claim
    (atomic add, any interleaving: round robin here) until a claim reaches the tile count.
    Returns (tile -> claim count, total claims)."""
    g = first_guarded_cta(grid, comm)
    joined = [b for b in range(grid) if b < g or guard_passes(b)]
    counter, owner, active = 0, {}, list(joined)
    while active:
        for b in list(active):
            t, counter = counter, counter + 1
            if t >= tiles:
                active.remove(b)
            else:
                owner[t] = owner.get(t, 0) + 1
    return owner, counter


@pytest.mark.parametrize("num_sms", [132, 78, 2])
def test_rule_keeps_one_claimer_and_the_dispatch_sms(num_sms):
    for comm_sms in range(1, num_sms + 2):
        comm, gemm = cuda_ep.split_sms(num_sms, comm_sms)
        for tiles in list(range(1, 2 * num_sms + 3)):
            grid = min(tiles, comm + gemm)  # the kernel's grid: every SM, clipped to the tiles
            g = first_guarded_cta(grid, comm)
            assert 1 <= g <= grid  # CTA 0 always claims
            assert g + comm <= num_sms  # the CTAs that may spin leave comm SMs
            if grid == num_sms:
                assert g == gemm  # a full grid: as before, the first num_sms - comm CTAs join
            # worst case: every guarded CTA finds a flag unpublished and leaves
            owner, counter = _claims(tiles, grid, comm, lambda b: False)
            assert owner == {t: 1 for t in range(tiles)}
            assert counter == tiles + g
            owner, counter = _claims(tiles, grid, comm, lambda b: True)
            assert owner == {t: 1 for t in range(tiles)} and counter == tiles + grid


def test_the_failing_ep_check_shape():
    """The check that failed (GPT-OSS: Tc 301, k 4, 16 experts on 2 ranks, 2I = 256: one column tile;
    comm 64): 27 tiles, a grid of 27, all of it at or past grid - comm. The old rule (grid - comm)
    guarded every CTA: with the dispatch not yet published, no tile was computed."""
    cap = cuda_ep.schedule_capacity(301, 4, 8, 2, 2.0)
    tiles = cap // TILE_M
    comm, gemm = cuda_ep.split_sms(132, 64)
    grid = min(tiles, comm + gemm)
    assert (tiles, grid, comm) == (27, 27, 64)
    assert grid - comm <= 0  # the old rule: no CTA joins unconditionally
    assert first_guarded_cta(grid, comm) == 1
    owner, _ = _claims(tiles, grid, comm, lambda b: False)
    assert sorted(owner) == list(range(tiles))
