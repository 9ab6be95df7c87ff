"""Dynamic (atomic-counter) tile scheduling for the persistent grouped GEMM (dynamic_tiles=True).

The static scheduler gives tile t to CTA t mod grid. With a grid of every SM beside a
comm kernel, tiles of CTAs that become resident only after the comm kernel ends would
finish late. Here the producer warp of each CTA claims the next linear tile index with
one atomic add on a global counter (zeroed by the caller before the launch), so any
CTA that is resident takes the next tile, in ascending order, and a CTA stops at the
first claim >= the tile count.

The producer hands every claimed index (and the final stop index) to the two consumer
warp groups of its CTA through a ring of RING_STAGES int32 slots in shared memory,
guarded by a PipelineAsync (full barrier: the 32 producer lanes arrive after lane 0
wrote the slot; empty barrier: the 256 consumer threads arrive after reading it). The
i-th index of a CTA uses slot i % RING_STAGES; i is the scheduler's tile counter, so no
extra loop-carried state is needed. Each tile's work is that of the static kernel
(same _tile_coord, K order, epilogue): its bits do not depend on which CTA computes it.

DynamicTileScheduler subclasses StaticPersistentTileScheduler so that the kernel's
loops (`while work.is_valid_tile: ... sched.advance_to_next_work()`) stay as they are.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils

RING_STAGES = 4  # claimed indices in flight from producer to consumers (a few: claims are cheap)


def first_guarded_cta(grid, comm):
    """Dispatch pair (_ready_dyn): CTAs below this index always claim tiles; those at or above it
    join only once the dispatch's first tiles are published (grouped_gemm._may_join).

    grid - comm keeps comm SMs free for the dispatch; at least 1, so that one CTA always claims:
    a claiming CTA claims until the counter passes the last tile, so every tile is computed even
    if every other CTA leaves. (grid - comm alone was <= 0 when the grid, clipped to the tile
    count, had no more CTAs than the dispatch: then every CTA could leave and no tile was computed,
    with no error flag: docs/ep.md.) Safe: max(grid - comm, 1) + comm <= SMs, as comm < SMs.
    Python ints or DSL Int32 alike (tests/test_tile_queue_rule.py checks the rule on the CPU)."""
    return cutlass.max(grid - comm, 1)


def make_tile_pipe(barrier_ptr, num_consumer_threads: int):
    """The ring's barriers: producer = the 32 lanes of warp 0, consumers = every consumer thread."""
    return pipeline.PipelineAsync.create(
        barrier_storage=barrier_ptr,
        num_stages=RING_STAGES,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 32),
        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, num_consumer_threads),
    )


class DynamicTileScheduler(utils.StaticPersistentTileScheduler):
    """producer=True: claims (atomic add on counter[0]) and publishes into the ring; False: reads it.

    join (producer only): 0 makes this CTA take no tile (its first index is the stop index)."""

    def __init__(self, params, num_clusters, linear, cta_id, executed, tile_pipe, ring, counter, producer, join):
        super().__init__(params, num_clusters, linear, cta_id, executed)
        self.tile_pipe = tile_pipe
        self.ring = ring
        self.counter = counter
        self.producer = producer
        self.join = join

    def __new_from_mlir_values__(self, values):
        base = super().__new_from_mlir_values__(values)
        return DynamicTileScheduler(
            base.params, base.num_persistent_clusters, base._current_work_linear_idx, base.cta_id_in_cluster,
            base._num_tiles_executed, self.tile_pipe, self.ring, self.counter, self.producer, self.join,
        )

    @staticmethod
    def create(params, block_idx, grid_dim, tile_pipe, ring, counter, producer: bool, join=None):
        base = utils.StaticPersistentTileScheduler.create(params, block_idx, grid_dim)
        return DynamicTileScheduler(
            base.params, base.num_persistent_clusters, base._current_work_linear_idx, base.cta_id_in_cluster,
            base._num_tiles_executed, tile_pipe, ring, counter, producer, join,
        )

    @cute.jit
    def _fetch(self, i: cutlass.Int32, join: cutlass.Int32):
        """The CTA's i-th tile index (0-based) into _current_work_linear_idx."""
        stages = RING_STAGES
        if cutlass.const_expr(self.producer):
            total = cute.size(self.params.problem_layout_ncluster_mnl)
            t = cutlass.Int32(total)
            if join != 0:
                if cute.arch.lane_idx() == 0:
                    ptr = cute.make_ptr(cutlass.Int32, self.counter.iterator.toint(), cute.AddressSpace.gmem,
                                        assumed_align=4)
                    t = cute.arch.atomic_add(ptr, cutlass.Int32(1), sem="relaxed", scope="gpu")
                t = cute.arch.shuffle_sync(t, 0)
            # Producer phase starts at 1 (a fresh empty barrier passes), as make_pipeline_state does.
            state = pipeline.PipelineState(stages, i, i % stages, ((i // stages) % 2) ^ 1)
            self.tile_pipe.producer_acquire(state)
            if cute.arch.lane_idx() == 0:
                self.ring[state.index] = t
            self.tile_pipe.producer_commit(state)  # every lane arrives; lane 0's after its store
            self._current_work_linear_idx = t
        else:
            state = pipeline.PipelineState(stages, i, i % stages, (i // stages) % 2)
            self.tile_pipe.consumer_wait(state)
            t = self.ring[state.index]
            self.tile_pipe.consumer_release(state)  # the value is in a register now
            self._current_work_linear_idx = t

    @cute.jit
    def initial_work_tile_info(self):
        join = cutlass.Int32(1)
        if cutlass.const_expr(self.join is not None):
            join = self.join
        self._fetch(self._num_tiles_executed, join)
        return self.get_current_work()

    @cute.jit
    def advance_to_next_work(self, *, advance_count: int = 1):
        self._num_tiles_executed += cutlass.Int32(1)
        self._fetch(self._num_tiles_executed, cutlass.Int32(1))
