"""Dynamic (atomic-counter) tile scheduling for the persistent grouped GEMM (VarlenMGroupedGemmDyn).

The static scheduler gives tile t to CTA t mod grid, so a CTA whose tiles ran short (consumer
warp groups that skip the MMA of all-padding rows) waits for its next static turn while
others still work. Here the producer warp of each CTA claims the next linear tile index with
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


def make_tile_pipe(barrier_ptr, num_consumer_threads: int):
    """The ring's barriers: producer = the 32 lanes of warp 0, consumers = every consumer thread."""
    return pipeline.PipelineAsync.create(
        barrier_storage=barrier_ptr,
        num_stages=RING_STAGES,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 32),
        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, num_consumer_threads),
    )


class DynamicTileScheduler(utils.StaticPersistentTileScheduler):
    """producer=True: claims (atomic add on counter[0]) and publishes into the ring; False: reads it."""

    def __init__(self, params, num_clusters, linear, cta_id, executed, tile_pipe, ring, counter, producer):
        super().__init__(params, num_clusters, linear, cta_id, executed)
        self.tile_pipe = tile_pipe
        self.ring = ring
        self.counter = counter
        self.producer = producer

    def __new_from_mlir_values__(self, values):
        base = super().__new_from_mlir_values__(values)
        return DynamicTileScheduler(
            base.params, base.num_persistent_clusters, base._current_work_linear_idx, base.cta_id_in_cluster,
            base._num_tiles_executed, self.tile_pipe, self.ring, self.counter, self.producer,
        )

    @staticmethod
    def create(params, block_idx, grid_dim, tile_pipe, ring, counter, producer: bool):
        base = utils.StaticPersistentTileScheduler.create(params, block_idx, grid_dim)
        return DynamicTileScheduler(
            base.params, base.num_persistent_clusters, base._current_work_linear_idx, base.cta_id_in_cluster,
            base._num_tiles_executed, tile_pipe, ring, counter, producer,
        )

    @cute.jit
    def _fetch(self, i: cutlass.Int32):
        """The CTA's i-th tile index (0-based) into _current_work_linear_idx."""
        stages = RING_STAGES
        if cutlass.const_expr(self.producer):
            total = cute.size(self.params.problem_layout_ncluster_mnl)
            t = cutlass.Int32(total)
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
        self._fetch(self._num_tiles_executed)
        return self.get_current_work()

    @cute.jit
    def advance_to_next_work(self, *, advance_count: int = 1):
        self._num_tiles_executed += cutlass.Int32(1)
        self._fetch(self._num_tiles_executed)
