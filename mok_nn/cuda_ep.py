"""Expert parallelism on one NVLink domain: symmetric memory + CuTe DSL kernels (EP = P > 1).

With P ranks, rank r holds experts [r*E_l, (r+1)*E_l). Every rank keeps one
symmetric-memory buffer (torch.distributed._symmetric_memory), mapped into each
peer, holding these sections (Tc = token capacity per rank, the same on all):

  tokens  [P*Tc + 1, H] bf16   rows [s*Tc, s*Tc + T_s): token rows of source s
                               (own rows copied in, peer rows pushed or pulled in where the
                               dispatch moves them); the last row stays zero (padding rows read it)
  dy      [P*Tc + 1, H] bf16   the same for d y in the backward
  slots   [Tc*k, H]     bf16   combine slots: expert ranks push row (t, j) to t*k + j
  dxslots [Tc*k, H]     bf16   d x of each routed row, pushed back the same way
  partials [P, Tc, H]   fp32   per-rank partial sums (combine_sums "rank"): [q, t] = rank q's node of
                               token t's combine tree (y in the forward, d x in the backward)
  ids     [P, Tc, k]    int64  all-gathered top-k ids (-1 past a rank's tokens)
  weights [P*Tc*k + 1]  fp32   all-gathered top-k weights, slot (s, t, j) at (s*Tc + t)*k + j; the
                               last element stays zero (padding rows read it)
  dwslots [P, Tc*k]     fp32   d top-k weight of each slot: row q written (densely) by expert rank q,
                               the source reads slot (t, j) from row ids[t, j] // E_l
  ntok    [P]           int32  token count of each rank's current forward (rank s writes slot s; the
                               backward reuses its forward's verdict)
  pad     [P]           int32  signal pad: slot s is written by rank s

Forward (no host synchronisation; every peer write is a unicast store):
  1. publish (SymmBuffers.publish, one mok_ep_publish launch): x into own tokens rows (token_rows_mode
     'push': into every rank's); own ids / fp32 weights / token count into every rank's ids / weights / ntok
  2. barrier, at the end of the same launch
  3. schedule of the local experts from all ranks' ids (ep_schedule: the single-GPU schedule kernel over
     relabelled experts, then mok_ep_schedule_outputs, replayed as one CUDA graph): rows ordered by
     (local expert, source rank, token, j), each expert padded to the GEMM tile, capacity from
     MoKConfig.schedule_capacity_multiplier
  4. dispatch into the GEMM's row order (token_rows_mode): 'scatter' where nearly every token has an
     expert on every rank (mok_scatter_rows_peers reads each peer row it needs from that peer's own
     section, once, over NVLink), else 'needed' (mok_ep_pull_peers pulls the rows the local experts need
     into the local tokens section, in the schedule's graph; EPSchedule.gather_rows then orders them)
  5. gate/up GEMM -> activation -> down GEMM (the single-GPU kernels, cuda_backend)
  6. combine push (down_push): the down GEMM sends its rows itself, mok_gemm_bk_ef_push's idle producer
     warps storing each finished tile's rows into slots[t*k + j] of their source rank. Where it cannot
     (a down-projection bias, MOK_GEMM / MOK_EP_COPY=torch, off the GPU): the GEMM, then mok_ep_partial_push
     (combine_sums 'rank': this rank's node of each token's combine tree, one fp32 row per token, into the
     source's partials[rank, t]) or mok_ep_push_peers (one bf16 row per slot into slots[t*k + j])
  7. barrier; 8. on the source, the rest of the tree over the ranks' nodes (mok_combine_final), or
     the whole tree over the k slots (mok_combine). Either way every addition of the tree happens
     in the order of the single-GPU combine: bitwise the EP = 1 results
Backward mirrors it: the forward's x rows are kept (EPSaved.x_rows); d y rows move as the forward's
token rows do (dy_rows_mode); dgrad + dSwiGLU + weight gradients locally; d x back to the sources
(dx_push_mode: where H <= DX_PUSH_GEMM_MAX_H the dgrad of gate/up sends its d x rows to the sources'
dxslots itself, else per-rank d x sums staged locally and sent by the copy engines on a side stream
while the weight gradients run) and d w to the sources' dwslots; barrier; fixed-order sums. Each slot
is written exactly once and every sum has a fixed order, so results are bitwise reproducible, and the
row order inside an expert is the one of the reference EP path (source rank, then slot order).

MOK_EP_COPY=torch: the row copies (publish, pull, push) by torch ops, the oracle; the CPU simulation
(tests/test_cuda_ep_simulated.py) runs on them. MOK_EP_TIMEOUT_S bounds every wait for a peer.

Errors: an overflow of the schedule capacity (detected on every rank from the
all-gathered routing), a peer that never signals (the barrier gives up after
a timeout and sets a flag) or a rank called with more tokens than the token
capacity turns the step's outputs into NaN and is raised as EPError by the next
EP call on this workspace once the step has finished (`check_errors(ws)` waits
for it).

Token capacity Tc: the largest first batch of any rank (collective at the first
call), or `reserve_tokens(ws, n)` (collective, any time between steps). A rank
cannot grow the symmetric buffer alone, and its peers cannot know its token count
on the host without a host synchronisation every call. So a batch above Tc takes
part in the step with its first Tc tokens, every rank sees the counts (`ntok`)
and flags the step (NaN outputs, EPError naming the count), and the next forward
on every rank after that EPError re-creates the buffer for the larger count, all
ranks in the same call provided they raised it at the same point (call
`check_errors(ws)` on every rank, e.g. at the end of each step).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from . import cuda_backend as cb
from . import distributed
from .envvars import getenv
from .kernels.registry import EP_SCHED_THREADS, TILE_M

DEFAULT_TIMEOUT_S = float(getenv("MOK_EP_TIMEOUT_S", "300"))
COPY_MODES = ("kernel", "torch")  # MOK_EP_COPY; the first is the default
# token_rows_mode: the peers' rows are read by the gather where at least this share of a peer's tokens has an
# expert here (uniform routing), else only the needed rows are pulled
PULL_ALL_MIN_SHARE = 0.9
COPY_CTAS_PER_SM = 4  # grid of the row copies: at most this many CTAs per SM


EPError = distributed.EPError  # one error type for both EP paths (the portable backend raises it too)


def timeout_us(timeout_s: float) -> int:
    """A wait bound of the EP kernels (int32 microseconds) from MOK_EP_TIMEOUT_S's seconds."""
    return int(min(timeout_s * 1e6, 2**31 - 1))


# --------------------------------------------------------------------------
# pure logic (CPU-testable)


def schedule_capacity(tokens_cap: int, top_k: int, experts_per_rank: int, ep_size: int,
                      multiplier: float | None) -> int:
    """Rows of each rank's expert buffers: multiplier x the balanced load (Tc*k) plus per-expert padding,
    never more than the worst case (every slot of every rank here; multiplier None: the worst case), rounded
    to the GEMM tile."""
    balanced = tokens_cap * top_k
    worst = ep_size * balanced
    bound = worst if multiplier is None else min(int(-(-multiplier * balanced // 1)), worst)
    rows = bound + experts_per_rank * (TILE_M - 1)
    return max(TILE_M, -(-rows // TILE_M) * TILE_M)


def check_group_shapes(mine: list[int], everyone: list[list[int]], names: list[str]) -> None:
    """Raise ValueError naming every field on which the ranks disagree."""
    bad = [f"{n}: {[row[i] for row in everyone]}" for i, n in enumerate(names)
           if any(row[i] != everyone[0][i] for row in everyone)]
    if bad:
        raise ValueError("mok_nn expert parallelism: the ranks of ep_group disagree on "
                         + "; ".join(bad) + " (values listed by rank)")


@dataclass
class EPSchedule:
    """The rows this rank computes, from all ranks' routing.

    sched: cuda_backend.Schedule of the local experts; row_token indexes the tokens
        section ([P*Tc + 1, H], padding -> the zero row P*Tc), pos [T, k] = t*k + j
        (the slot rows the combine reads).
    row_src / row_slot [cap] int64: source rank and slot t*k + j of each row, -1 on padding.
    row_gslot [cap] int64: s*Tc*k + t*k + j (index into the all-gathered weights), P*Tc*k on padding.
    pull_src [P, Tc] int64: tokens row to pull from source s, -1 where not needed (or s == rank).
    overflow [] bool: some rank's rows exceed the capacity.
    sched.seg_rows [E_l] int32: real (routed) rows of each local expert inside its segment
        (clipped to the segment when the capacity overflowed).
    sched.row_expert is None (derived from tile_expert where needed: the segments are tile-aligned).
    slot_row [P*Tc*k] int64: row of global slot s*Tc*k + t*k + j in make_ep_schedule's bucket schedule:
        this rank's row where the slot is routed here (>= cap where the capacity cut it), else a row
        after all of this rank's.
    """

    sched: cb.Schedule
    row_gslot: torch.Tensor
    pull_src: torch.Tensor
    slot_row: torch.Tensor | None = None
    # Computes {"row_src", "row_slot", "overflow"} on first use of any of them: make_ep_schedule
    # leaves these to after the first GEMM's launch, which they are not needed for (on the host,
    # each torch op before that launch delays the GPU's start).
    derive: object = field(default=None, repr=False)
    # Where the tensors are views of the schedule graph's output buffer (which its next replay rewrites):
    # a callable returning this schedule on a copy of that buffer (see kept)
    copy: object = field(default=None, repr=False)

    def kept(self) -> "EPSchedule":
        """This schedule on tensors of its own, for what outlives the forward (its backward): a copy of
        the graph's buffer where the tensors are views of it, else self. Kernels issued before the next
        replay (stream order) may read the views directly; only the saved schedule needs the copy, so
        the forward takes it after its launches, not on the host path before its first GEMM."""
        return self if self.copy is None else self.copy()

    def token_slots(self) -> torch.Tensor | None:
        """slot_row as [P*Tc, k]: the rows of each token row of the tokens / dy sections (row s*Tc + t), as
        cb.take_rows' scatter form reads them; None where slot_row is not known."""
        if self.slot_row is None:
            return None
        return self.slot_row.view(self.pull_src.numel(), -1)

    def gather_rows(self, section: torch.Tensor, skip_tail: bool = True) -> torch.Tensor:
        """The rows of a tokens / dy section ([P*Tc + 1, H], a zero row last) in this schedule's row order,
        as cb.gather_rows gives them at EP = 1; skip_tail: the rows past the last segment unwritten (what only
        the GEMMs and the weight gradients read)."""
        return cb.take_rows(section, self.sched.row_token, has_zero_row=True, slots=self.token_slots(),
                            tile_expert=self.sched.tile_expert if skip_tail else None)

    def _derived(self, name: str) -> torch.Tensor:
        self.__dict__.update(self.derive())  # where functools.cached_property keeps its values
        return self.__dict__[name]

    @functools.cached_property
    def row_src(self) -> torch.Tensor:
        return self._derived("row_src")

    @functools.cached_property
    def row_slot(self) -> torch.Tensor:
        return self._derived("row_slot")

    @functools.cached_property
    def overflow(self) -> torch.Tensor:
        return self._derived("overflow")


def push_split(row_rank: torch.Tensor, ep_size: int) -> torch.Tensor:
    """[P, M] int64: row r in row p where row_rank[r] == p, else -1 (the rows each rank receives)."""
    rows = _cached("arange", row_rank.numel(), row_rank.device)
    return torch.where(row_rank.unsqueeze(0) == _cached("arange", ep_size, row_rank.device).unsqueeze(1), rows, -1)


_CACHED: dict = {}  # (kind, dtype, device) -> constant tensor (arange / ones), grown as needed


def _cached(kind: str, n: int, device, dtype=torch.int64) -> torch.Tensor:
    """[n] view of a per-device constant ("arange" or "ones") kept across calls, so that the
    per-call bookkeeping does not rebuild (launch) it. Read-only: callers never write into it."""
    key = (kind, dtype, torch.device(device))
    t = _CACHED.get(key)
    if t is None or t.numel() < n:
        wide = dtype in (torch.int64, torch.float32)  # a narrow arange must not outgrow its range
        size = max(n, 2 * t.numel()) if t is not None and wide else n
        t = torch.arange(size, dtype=dtype, device=device) if kind == "arange" else \
            torch.ones(size, dtype=dtype, device=device)
        _CACHED[key] = t
    return t[:n]


_TABLES: dict = {}  # (name, shape parameters, device) -> constant lookup table (make_ep_schedule)


def _table(key: tuple, build) -> torch.Tensor:
    """A lookup table for one shape and device, built once (on the first call) and kept: read-only."""
    t = _TABLES.get(key)
    if t is None:
        t = _TABLES[key] = build()
    return t


def spread_buckets(num_experts: int) -> bool:
    """Whether make_ep_schedule gives every expert its own bucket of the single-GPU schedule (and the
    -1 slots one more): where the schedule kernel holds E + 1 experts. Else one bucket holds all
    experts of the other ranks and the -1 slots."""
    return num_experts + 1 <= cb.SCHEDULE_MAX_EXPERTS


def _bucket_table(num_experts: int, rank: int, e_l: int, spread: bool, dev) -> torch.Tensor:
    """[E + 1] int64, read at id + 1 (bucket_keys): the bucket of global expert g at index g + 1, the bucket of
    the -1 slots (no token) at index 0. This rank's experts first (bucket g - rank*E_l); spread: the others
    (rank order from rank + 1, wrapping) and then -1 (bucket E), else all of them and -1 in bucket E_l."""
    def build():
        g = torch.arange(-1, num_experts)
        local = (g - rank * e_l) % num_experts
        if spread:
            return torch.where(g >= 0, local, num_experts).to(dev)
        return torch.where((g >= 0) & (local < e_l), local, e_l).to(dev)
    return _table(("bucket", num_experts, rank, e_l, spread, torch.device(dev)), build)


def bucket_keys(flat_ids: torch.Tensor, num_experts: int, rank: int, e_l: int, spread: bool) -> torch.Tensor:
    """The bucket of each id of flat_ids (-1: no token). By index_select at id + 1, which checks its indices:
    an id outside [-1, E) raises (IndexError on the CPU, torch's device-side index assert on CUDA) instead of
    wrapping to another expert, as indexing the table by the ids did (-2 read expert E - 1; E read the
    no-token bucket). A -1 reads as no token here: the publish kernel has already stopped on any -1 in a rank's
    own topk_ids (kernels/id_check.py), so the only -1 left are its marks for tokens past a rank's count."""
    return _bucket_table(num_experts, rank, e_l, spread, flat_ids.device).index_select(0, flat_ids + 1)


def _slot_tables(ep_size: int, tc: int, top_k: int, dev) -> tuple[torch.Tensor, torch.Tensor]:
    """[n + 1] int64 each (n = P*Tc*k): source rank and slot t*k + j of global slot s*Tc*k + t*k + j;
    -1 at n (padding)."""
    def build(kind):
        def f():
            n = ep_size * tc * top_k
            g = torch.arange(n + 1)
            v = g // (tc * top_k) if kind == "src" else g % (tc * top_k)
            return torch.where(g < n, v, -1).to(dev)
        return f
    key = (ep_size, tc, top_k, torch.device(dev))
    return _table(("src",) + key, build("src")), _table(("slot",) + key, build("slot"))


def _pull_table(ep_size: int, tc: int, rank: int, dev) -> torch.Tensor:
    """[P, Tc] int64: tokens row s*Tc + t of (s, t), -1 on this rank's own row s = rank (already local)."""
    def build():
        t = torch.arange(ep_size * tc).view(ep_size, tc)
        t[rank] = -1
        return t.to(dev)
    return _table(("pull", ep_size, tc, rank, torch.device(dev)), build)


def make_ep_schedule(ids_all: torch.Tensor, num_tokens: int, rank: int, experts_per_rank: int,
                     capacity: int, out: dict | None = None) -> EPSchedule:
    """This rank's rows from the all-gathered ids [P, Tc, k] (-1 = no token), by the single-GPU
    schedule (cb.make_schedule: one kernel on CUDA, count -> pad -> prefix sum, no atomics).

    The single-GPU schedule runs over the n = P*Tc*k slots taken as tokens of one slot each (so its
    row_token is the global slot s*Tc*k + t*k + j), with the experts relabelled into buckets, this
    rank's experts first (_bucket_table). Within a bucket it keeps slot order, i.e. (source rank,
    token, j), and pads each bucket to the tile: its first `capacity` rows up to the end of this
    rank's buckets are exactly this rank's rows. With spread buckets the same segment ends give
    every rank's padded load (an overflow anywhere is known everywhere, from the same ids).

    On CUDA the outputs derived from the bucket schedule come from one mok_ep_schedule_outputs launch
    (kernels/ep_schedule.py), written into out[name] where given (tensors of the outputs' shapes: the
    schedule graph's buffer); elsewhere from the torch ops below, which that kernel reproduces bit for bit.
    """
    ep_size, tc, top_k = ids_all.shape
    dev = ids_all.device
    e_l = experts_per_rank
    num_experts = e_l * ep_size
    n = ep_size * tc * top_k
    spread = spread_buckets(num_experts)
    buckets = num_experts + 1 if spread else e_l + 1
    flat = ids_all.reshape(-1)
    key = bucket_keys(flat, num_experts, rank, e_l, spread)
    full_cap = max(cb.schedule_capacity(n, 1, buckets), capacity)  # also holds the other buckets
    full = cb.make_schedule(key.view(n, 1), buckets, full_cap)
    pos = _cached("arange", num_tokens * top_k, dev).view(num_tokens, top_k)
    if ids_all.is_cuda:
        o = _outputs_kernel(full, key, rank, e_l, capacity, ep_size, tc, top_k, spread, out or {})
        sched = cb.Schedule(pos, o["row_token"], o["tile_expert"], o["seg_end"], o["seg_rows"],
                            padded_rows=o["padded_rows"])
        load = o["load"]

        def derive():  # (the kernel wrote row_src and row_slot already)
            overflow = (load > capacity).any() if spread else _overflow_by_count(flat, ep_size, e_l, capacity)
            return {"row_src": o["row_src"], "row_slot": o["row_slot"], "overflow": overflow}

        return EPSchedule(sched, o["row_gslot"], o["pull_src"], full.pos.view(n), derive)

    zero = _cached("arange", 1, dev, torch.int32)
    bounds = torch.cat([zero, full.seg_end])  # [buckets + 1]: bucket b holds rows bounds[b] .. bounds[b + 1]
    seg_end = bounds[1:e_l + 1].clamp(max=capacity)  # cut only past the capacity (overflow, flagged)
    # routed rows kept per local expert: all, or those before the capacity (overflow)
    seg_rows = torch.clamp(capacity - bounds[:e_l], min=zero, max=full.seg_rows[:e_l])

    rows = _cached("arange", capacity, dev)
    # rows past this rank's buckets (other ranks' slots, or padding): the padding slot n
    row_gslot = torch.where(rows < bounds[e_l], full.row_token[:capacity], n)
    row_token = row_gslot // top_k  # s*Tc + t; padding: n // k = P*Tc, the zero row
    te = full.tile_expert[:capacity // TILE_M]
    tile_expert = torch.where(te < e_l, te, -1)  # other buckets: past this rank's segments
    sched = cb.Schedule(pos, row_token, tile_expert, seg_end, seg_rows)

    need = (key < e_l).view(ep_size, tc, top_k).any(dim=2)
    pull_src = torch.where(need, _pull_table(ep_size, tc, rank, dev), -1)

    def derive():  # what the GEMMs do not need (EPSchedule.derive)
        if spread:  # padded rows of every rank (this one first): ends of its buckets minus starts
            load = bounds[e_l:num_experts + 1:e_l] - bounds[0:num_experts:e_l]
            overflow = (load > capacity).any()
        else:
            overflow = _overflow_by_count(flat, ep_size, e_l, capacity)
        src_of, slot_of = _slot_tables(ep_size, tc, top_k, dev)
        return {"row_src": src_of[row_gslot], "row_slot": slot_of[row_gslot], "overflow": overflow}

    return EPSchedule(sched, row_gslot, pull_src, full.pos.view(n), derive)


def _overflow_by_count(flat: torch.Tensor, ep_size: int, e_l: int, capacity: int) -> torch.Tensor:
    """[] bool: some rank's padded rows exceed the capacity, from every expert's count (+ TILE_M - 1 to round
    up; the -1 slots in the extra entry E): where the other ranks' experts share one bucket."""
    num_experts = ep_size * e_l
    cnt = torch.full((num_experts + 1,), TILE_M - 1, dtype=torch.int64, device=flat.device)
    cnt.scatter_add_(0, flat % (num_experts + 1), _cached("ones", flat.numel(), flat.device))
    tiles = (cnt[:num_experts] // TILE_M).view(ep_size, e_l).sum(dim=1)
    return (tiles > capacity // TILE_M).any()


def _outputs_kernel(full, key, rank, e_l, capacity, ep_size, tc, top_k, spread, out: dict) -> dict:
    """make_ep_schedule's derived outputs by one mok_ep_schedule_outputs launch, into out[name] where given."""
    dev = key.device

    def take(name, shape, dtype):
        t = out.get(name)
        if t is None:
            return torch.empty(shape, dtype=dtype, device=dev)
        assert t.shape == shape and t.dtype == dtype and t.is_contiguous(), name
        return t

    i64, i32 = torch.int64, torch.int32
    o = {name: take(name, (capacity,), i64) for name in ("row_token", "row_gslot", "row_src", "row_slot")}
    o["tile_expert"] = take("tile_expert", (capacity // TILE_M,), i32)
    o.update({name: take(name, (e_l,), i32) for name in ("seg_end", "seg_rows", "padded_rows")})
    o["pull_src"] = take("pull_src", (ep_size, tc), i64)
    o["load"] = torch.empty(ep_size if spread else 1, dtype=i32, device=dev)  # (bucket ends of every rank: spread)
    grid = max(1, min(-(-max(capacity, ep_size * tc) // EP_SCHED_THREADS), 4 * cb.num_sms(dev)))
    cb._lib().launch("mok_ep_schedule_outputs", full.row_token, full.tile_expert, full.seg_end, full.seg_rows,
                     key, o["row_token"], o["row_gslot"], o["row_src"], o["row_slot"], o["tile_expert"],
                     o["seg_end"], o["seg_rows"], o["padded_rows"], o["pull_src"].view(-1), o["load"], rank, top_k,
                     tc, grid, stream=cb._stream())
    return o


# --------------------------------------------------------------------------
# the EP schedule as one CUDA graph replay


# (ids address, shapes, rank, E_l, capacity, device, captured pull) -> _GraphedSchedule
_SCHED_GRAPHS: dict = {}


class _GraphedSchedule:
    """make_ep_schedule(ids_all, ...) for one buffer and shape, captured once as a CUDA graph.

    The forward issues the schedule between its first barrier and its first GEMM, where the GPU waits for
    the host (25-40 us per launch): the bucket schedule, its outputs' kernel and ~5 small torch ops cost
    one launch as a replay. The graph reads the ids section in place (its address is part of the key) and
    writes every output into one flat byte buffer. Each call replays it and returns views of that buffer,
    made once: the next replay overwrites them, so what outlives the call takes EPSchedule.kept(), one
    clone, issued after the forward's launches (the forward's saved schedule, which later replays
    never touch). Forwards on one workspace must be issued in one stream order, as the symmetric
    buffer's sections require anyway. The
    constant tensors the captured ops read (the _CACHED and _TABLES entries) are kept alive here.
    Same kernels, same inputs: bitwise the eager make_ep_schedule.
    """

    _FIELDS = ("row_token", "tile_expert", "seg_end", "seg_rows", "padded_rows", "row_gslot", "pull_src",
               "slot_row", "row_src", "row_slot", "overflow")

    def __init__(self, ids_all, rank, e_l, capacity, pull=None):
        # pull: (kind, fn) to capture the forward's pull of the peers' token rows as well (ep_schedule):
        # kind "all": fn() pulls every row, on a branch of the graph beside the schedule; "needed":
        # fn(eps) pulls the rows of eps.pull_src after it. None: the graph is the schedule alone.
        self.fields = self._FIELDS
        kind, fn = pull if pull is not None else (None, None)
        # The schedule depends on this rank's token count only through `pos` (an arange view, built per
        # call below), so one graph serves every count: captured with the capacity's count.
        self.args = (ids_all.shape[1], rank, e_l, capacity)
        # warm-up: modules loaded, tables and constants built (the pull runs for real: this call needs it)
        if kind == "all":
            fn()
        warm = make_ep_schedule(ids_all, *self.args)
        # (byte offset, bytes, dtype, shape, contiguous strides) of each output in the flat buffer;
        # offsets are multiples of 16 bytes, so each output is an element offset of a dtype view
        self.layout, off = [], 0
        for t in self._outputs(warm):
            nbytes = t.numel() * t.element_size()
            self.layout.append((off, nbytes, t.dtype, tuple(t.shape), torch.empty(t.shape, device="meta").stride()))
            off += -(-nbytes // 16) * 16
        if kind == "needed":
            fn(warm)
        side = torch.cuda.Stream(device=ids_all.device)
        side.wait_stream(torch.cuda.current_stream(ids_all.device))
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, stream=side, capture_error_mode="thread_local"):
            if kind == "all":
                branch = torch.cuda.Stream(device=ids_all.device)
                branch.wait_stream(side)
                with torch.cuda.stream(branch):
                    fn()
            self.flat = torch.empty(off, dtype=torch.uint8, device=ids_all.device)
            views = self._views(self.flat)
            # the outputs mok_ep_schedule_outputs writes land in the buffer itself; the others are copied
            eps = make_ep_schedule(ids_all, *self.args, out=views)
            for name, t in zip(self.fields, self._outputs(eps)):
                if t.data_ptr() != views[name].data_ptr():
                    views[name].copy_(t)
            if kind == "needed":
                fn(eps)
            elif kind == "all":
                side.wait_stream(branch)
        torch.cuda.current_stream(ids_all.device).wait_stream(side)
        self.static = views  # every replay rewrites self.flat in place
        self.replays = 0  # EPSchedule.kept() copies only the last replay's schedule
        self.keep = list(_CACHED.values()) + list(_TABLES.values())  # read by the graph: never freed

    @classmethod
    def _outputs(cls, eps):
        s = eps.sched
        return [s.row_token, s.tile_expert, s.seg_end, s.seg_rows, s.gemm_seg_rows(), eps.row_gslot, eps.pull_src,
                eps.slot_row, eps.row_src, eps.row_slot, eps.overflow]

    def _views(self, flat: torch.Tensor) -> dict:
        """{field: tensor} over a flat buffer of self.layout: one view per dtype and one as_strided per
        output (each torch op costs the host several us)."""
        by_dtype, f = {}, {}
        for name, (o, _, dt, shape, stride) in zip(self.fields, self.layout):
            base = by_dtype.get(dt)
            if base is None:
                base = by_dtype[dt] = flat.view(dt)
            f[name] = base.as_strided(shape, stride, o // base.element_size())
        return f

    def _schedule(self, f: dict, num_tokens: int) -> EPSchedule:
        top_k = f["slot_row"].numel() // f["pull_src"].numel()  # slots [P*Tc*k] per token row [P, Tc]
        pos = _cached("arange", num_tokens * top_k, self.flat.device).view(num_tokens, top_k)  # as make_ep_schedule
        sched = cb.Schedule(pos, f["row_token"], f["tile_expert"], f["seg_end"], f["seg_rows"],
                            padded_rows=f["padded_rows"])
        eps = EPSchedule(sched, f["row_gslot"], f["pull_src"], f["slot_row"])
        eps.__dict__.update(row_src=f["row_src"], row_slot=f["row_slot"], overflow=f["overflow"])
        return eps

    def __call__(self, num_tokens: int) -> EPSchedule:
        """Replays the graph. The schedule's tensors are views of the graph's own buffer, made once
        (self.static): valid until the next replay; EPSchedule.kept() copies them for the backward."""
        self.graph.replay()
        self.replays += 1
        eps = self._schedule(self.static, num_tokens)
        eps.copy = functools.partial(self._copy, num_tokens, self.replays)
        return eps

    def _copy(self, num_tokens: int, replay: int) -> EPSchedule:
        """The schedule of replay number `replay` on a copy of the graph's buffer (one clone); only while
        that replay is the last one (a later replay has overwritten the buffer)."""
        if replay != self.replays:
            raise RuntimeError("mok_nn: EPSchedule.kept() after a later replay of its schedule graph "
                               "(the forward must take its copy before the next forward on the workspace)")
        return self._schedule(self._views(self.flat.clone()), num_tokens)


def ep_schedule(ids_all, num_tokens, rank, e_l, capacity, pull: tuple | None = None) -> EPSchedule:
    """make_ep_schedule, replayed from a CUDA graph on CUDA (_GraphedSchedule), else eager (the CPU).

    pull: (kind, fn), the forward's pull of the peers' token rows (step 4), issued with the schedule:
    kind "all": fn() pulls every row (before the schedule; in the graph, on a branch beside it),
    "needed": fn(eps) pulls the rows of the schedule's pull_src (after it). With the kernel copies the
    graph captures the pull too: one launch for both where the host would issue two, in the stretch where
    the GPU waits for it (the torch copies, MOK_EP_COPY=torch, synchronise with the host: issued outside).
    The captured pull reads the buffer's addresses: the key holds the ids section's address, and
    _recreate drops every graph with the buffer."""
    kind, fn = pull if pull is not None else (None, None)
    graphed = _graph_schedule(ids_all)
    captured = kind if graphed and copy_mode() == "kernel" else None
    if kind == "all" and captured is None:
        fn()
    if not graphed:
        eps = make_ep_schedule(ids_all, num_tokens, rank, e_l, capacity)
        # slot_row is a view of the bucket schedule's one allocation (cb._schedule_buffers), which the backward
        # would keep alive whole through it: its own copy (the graph copies it into its buffer anyway)
        eps.slot_row = eps.slot_row.clone()
    else:
        key = (ids_all.data_ptr(), tuple(ids_all.shape), rank, e_l, capacity, ids_all.device, captured)
        g = _SCHED_GRAPHS.get(key)
        if g is None:
            if len(_SCHED_GRAPHS) >= 64:  # many workspaces / capacities: keep the memory bounded
                _SCHED_GRAPHS.clear()
            g = _SCHED_GRAPHS[key] = _GraphedSchedule(ids_all, rank, e_l, capacity, pull if captured else None)
        eps = g(num_tokens)
    if kind == "needed" and captured is None:
        fn(eps)
    return eps


def _graph_schedule(ids_all: torch.Tensor) -> bool:
    """ep_schedule replays a CUDA graph: on CUDA (tests/gpu/test_ep_one_gpu.py, whose threads share one GPU,
    patches this off: a capture while another thread issues work is invalidated)."""
    return ids_all.is_cuda


def copy_mode() -> str:
    """MOK_EP_COPY: 'kernel' (default: the EP kernels move the rows: mok_ep_publish, mok_ep_pull_peers,
    mok_ep_push_peers and the push GEMMs) or 'torch' (publish, pulls and pushes by torch ops and indexing: the
    oracle, which synchronises with the host; the CPU simulation runs on it)."""
    return cb.env_choice("MOK_EP_COPY", COPY_MODES, COPY_MODES[0])


def token_rows_mode(num_experts: int, ep_size: int, top_k: int) -> str:
    """How the forward's peer token rows reach the GEMM's rows: 'scatter' (no row moves before the barrier: the
    gather into the GEMM's row order reads each peer row it needs from that peer's own section over NVLink,
    once, mok_scatter_rows_peers) where a token has an expert on a given rank with probability >=
    PULL_ALL_MIN_SHARE under uniform routing (1 - C(E - E/P, k) / C(E, k): qwen3 and deepseek-v3 at P = 2,
    0.996; mixtral 0.79) and P <= 32, 'all' (every peer row pulled right after the barrier, beside the
    schedule) there above 32 ranks, else 'needed' (only the rows the local experts need, pulled once the
    schedule is built). Where scatter cannot run (scatter_from_ranks_ok: off the GPU, ...) the forward takes
    'push' instead (up to 32 ranks; each rank's publish stores its rows into every rank's section) or 'all'.
    The GEMMs read the same rows in every case."""
    e_l = num_experts // ep_size
    share = 1 - math.comb(num_experts - e_l, top_k) / math.comb(num_experts, top_k)
    if share < PULL_ALL_MIN_SHARE:
        return "needed"
    return "scatter" if ep_size <= 32 else "all"  # (measured at P = 2 only; the push fallback: a lane per rank)


def dy_rows_mode(num_experts: int, ep_size: int, top_k: int) -> str:
    """How the backward's d y rows reach the peers, as the forward's token rows go (token_rows_mode):
    'scatter' (its own section only; each peer's gather reads the rows it needs from there over NVLink:
    scatter_from_ranks) where those are scattered, else 'pull' (its own section only, then each peer pulls the
    rows it needs after the barrier). The backward pushes instead ('push': each rank copies its rows into its
    part of every peer's dy section before the barrier, one copy_ per peer) where scatter cannot run. The
    same rows either way."""
    return "scatter" if token_rows_mode(num_experts, ep_size, top_k) == "scatter" else "pull"


def _on_cuda(t: torch.Tensor) -> bool:
    return t.is_cuda  # (the CPU wiring tests stub the kernels and this)


def publish_kernel_ok(x: torch.Tensor) -> bool:
    """mok_ep_publish can take x: on the GPU, rows of 16-byte vectors, and the kernel copies (not
    MOK_EP_COPY=torch). Else the torch ops publish (SymmBuffers.publish_torch)."""
    return _on_cuda(x) and cb.rows_of_16_byte_vectors(x) and copy_mode() == "kernel"


def copy_grid(num_rows: int, num_sms: int, ctas_per_sm: int = COPY_CTAS_PER_SM) -> int:
    """CTAs of a grid-stride row copy: at most ctas_per_sm per SM (the warps walk the rows grid-stride), no
    more than one row per warp, at least one."""
    return cb.row_copy_grid(num_rows, num_sms, ctas_per_sm)


def combine_sums(num_experts: int, ep_size: int, top_k: int, hidden: bool = False) -> str:
    """How the combine (and the backward's d x), where the GEMM does not push its rows itself, crosses
    NVLink: 'rank' (each expert rank sends one fp32 partial sum per token, its node of the combine tree) or
    'slot' (one bf16 row per slot, summed on the source). Both give the same bits (and EP = 1's).

    'rank' where it sends fewer bytes, i.e. where a token's slots on one rank are more than 2 on average
    (top_k > 2 P: one 4-byte row instead of several 2-byte ones), or where the transfer is hidden
    (hidden=True: the backward's d x sums, sent by the copy engines beside the weight gradients); and only
    where P divides the tree's leaves (combine_leaves(E)). Else 'slot'. Measured on 2 H200 (docs/ep.md):
    qwen3 / deepseek-v3 (k = 8) forward 6-7% faster with 'rank'."""
    rank = top_k > 2 * ep_size or hidden
    return "rank" if rank and cb.combine_leaves(num_experts) % ep_size == 0 else "slot"


def _gemm_push_ok(a: torch.Tensor) -> bool:
    """The push GEMMs (cb.grouped_gemm_push) can run on these rows: on the GPU, with the kernel GEMMs and
    copies (not MOK_GEMM / MOK_EP_COPY=torch)."""
    return _on_cuda(a) and copy_mode() != "torch" and not cb._use_torch_gemm()


def down_push(h: torch.Tensor, down_bias: bool) -> bool:
    """Whether the forward's down GEMM sends its rows itself: its idle producer warps store each finished
    tile's rows into their source ranks' slots section while the next tiles are computed
    (cb.grouped_gemm_push), then the slot-form combine runs. Not with a down-projection bias (added after the
    GEMM) or where _gemm_push_ok fails: there the GEMM, then the push of combine_sums' form. Same bits either
    way (the slot rows, as EP = 1). Measured on 2 H200 (docs/ep.md), forward against the GEMM then the push:
    qwen3 1.611 vs 1.686 ms, mixtral 9.65 vs 9.84, deepseek-v3 11.03 vs 11.17."""
    return not down_bias and _gemm_push_ok(h)


# dx_push_mode: 'gemm' where the rows are at most this wide, else 'copy_engine'. Side by side on 2 H200
# (docs/ep.md): qwen3 (H 2048) backward 2.536 / 2.519 ms with gemm against 2.648 / 2.594; mixtral (4096)
# 18.88 / 19.37 against 18.16 / 19.23 and deepseek-v3 (7168) 23.87 / 23.98 against 21.71 / 24.55: not faster.
DX_PUSH_GEMM_MAX_H = 2048


def dx_push_mode(hidden: int) -> str:
    """How the backward's d x (rows of `hidden` columns) reaches its sources: 'gemm' (hidden <=
    DX_PUSH_GEMM_MAX_H: the dgrad of gate/up sends each d x row to its source's dxslots itself, as the
    forward's down GEMM does its rows, down_push; then the slot-form combine; where _gemm_push_ok holds) or
    'copy_engine' (per-rank sums into a local staging block, then copied by the copy engines on a side stream
    while the weight gradients run, SymmBuffers.push_partials(copy_stream=...); off the GPU the summing
    kernel's stand-in stores them, after the weight gradients). The same bits either way."""
    return "gemm" if hidden <= DX_PUSH_GEMM_MAX_H else "copy_engine"


# --------------------------------------------------------------------------
# symmetric-memory buffers


_SECTION_ALIGN = 256


def buffer_layout(ep_size: int, tokens_cap: int, hidden: int, top_k: int) -> tuple[dict, int]:
    """{section: (byte offset, shape, dtype, nbytes)} and the total size of the symmetric buffer."""
    P, tc, k, h = ep_size, tokens_cap, top_k, hidden
    layout = [
        ("tokens", (P * tc + 1, h), torch.bfloat16),
        ("dy", (P * tc + 1, h), torch.bfloat16),
        ("slots", (tc * k, h), torch.bfloat16),
        ("dxslots", (tc * k, h), torch.bfloat16),
        ("partials", (P, tc, h), torch.float32),
        ("ids", (P, tc, k), torch.int64),
        ("weights", (P * tc * k + 1,), torch.float32),
        ("dwslots", (P, tc * k), torch.float32),
        ("ntok", (P,), torch.int32),
        ("pad", (P,), torch.int32),
    ]
    sections, off = {}, 0
    for name, shape, dtype in layout:
        nbytes = dtype.itemsize
        for s in shape:
            nbytes *= s
        sections[name] = (off, shape, dtype, nbytes)
        off += -(-nbytes // _SECTION_ALIGN) * _SECTION_ALIGN
    return sections, off


class SymmBuffers:
    """The sections of one symmetric buffer, locally and as seen in each peer.

    raws[p] is rank p's buffer as addressed from this GPU (raws[rank] is the local one).
    """

    def __init__(self, raws: list, rank: int, tokens_cap: int, hidden: int, top_k: int, device,
                 timeout_s: float = DEFAULT_TIMEOUT_S):
        self.ep_size, self.rank = len(raws), rank
        self.tokens_cap, self.hidden, self.top_k = tokens_cap, hidden, top_k
        self.timeout_s = timeout_s
        self._sections, self.nbytes = buffer_layout(self.ep_size, tokens_cap, hidden, top_k)
        self.raw = raws[rank]
        self._views = [{name: self._carve(b, name) for name in self._sections} for b in raws]
        self.err = torch.zeros(1, dtype=torch.int32, device=device)  # sticky: a peer never signalled
        self.epoch = 0
        # CTAs of mok_ep_publish that have finished, for the barrier its last CTA runs (the kernel leaves it 0)
        self.arrivals = torch.zeros(1, dtype=torch.int32, device=device)

    @classmethod
    def create(cls, group, tokens_cap: int, hidden: int, top_k: int, device, timeout_s: float = DEFAULT_TIMEOUT_S):
        """Collective over group: allocate, zero and map the buffer of every rank (symmetric memory)."""
        import torch.distributed._symmetric_memory as symm_mem

        P, rank = dist.get_world_size(group), dist.get_rank(group)
        _, nbytes = buffer_layout(P, tokens_cap, hidden, top_k)
        raw = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
        raw.zero_()  # zero rows and pads before any peer can signal
        handle = symm_mem.rendezvous(raw, group)
        raws = [raw if p == rank else handle.get_buffer(p, (nbytes,), torch.uint8, 0) for p in range(P)]
        self = cls(raws, rank, tokens_cap, hidden, top_k, device, timeout_s)
        self.handle = handle
        torch.cuda.synchronize(device)
        dist.barrier(group=group)
        return self

    def _carve(self, raw: torch.Tensor, name: str) -> torch.Tensor:
        off, shape, dtype, nbytes = self._sections[name]
        return raw[off:off + nbytes].view(dtype).view(shape)

    def local(self, name: str) -> torch.Tensor:
        return self._views[self.rank][name]

    def peer(self, p: int, name: str) -> torch.Tensor:
        return self._views[p][name]

    def section_addrs(self, name: str) -> torch.Tensor:
        """[P] int64 on the GPU: the address of every rank's section as mapped here (own one included)."""
        cache = self.__dict__.setdefault("_addrs", {})
        if name not in cache:
            cache[name] = torch.tensor([self.peer(p, name).data_ptr() for p in range(self.ep_size)],
                                       dtype=torch.int64, device=self.err.device)
        return cache[name]

    def section_table(self, names: tuple) -> torch.Tensor:
        """[len(names), P] int64 on the GPU: section_addrs of each name, one table (one kernel argument)."""
        cache = self.__dict__.setdefault("_tables", {})
        if names not in cache:
            cache[names] = torch.stack([self.section_addrs(name) for name in names])
        return cache[names]

    def copy_to_peers(self, name: str, rows: torch.Tensor, n: int) -> None:
        """rows[:n] into this rank's rows (rank * Tc ..) of every peer's section `name`, one copy_ per peer."""
        r, tc = self.rank, self.tokens_cap
        for p in range(self.ep_size):
            if p != r:
                self.peer(p, name)[r * tc:r * tc + n].copy_(rows[:n])

    def publish(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_tokens: int,
                then_barrier: bool = False, push_rows: bool = False, num_experts: int | None = None) -> None:
        """Step 1 of the forward: x[:n] into this rank's rows of the local tokens section; topk_ids[:n]
        (-1 for tokens n..Tc-1), topk_weights[:n] as fp32 and num_tokens into this rank's part of every
        rank's ids / weights / ntok sections (n = min(num_tokens, Tc)). One mok_ep_publish launch where
        publish_kernel_ok(x), else the torch ops (publish_torch: the CPU simulation, MOK_EP_COPY=torch, rows
        the kernel cannot take). Peer stores are plain: the barrier that follows fences them.

        then_barrier: step 2 as well, the barrier(): at the end of the same launch (its last CTA signals
        every peer and waits for them: one launch less on the host before the GPU can go on), or after
        the torch ops.
        push_rows: x[:n] into this rank's rows of every rank's tokens section (own included), which is
        what a pull of every row (token_rows_mode) by each peer after the barrier would give; stored by the
        same launch, so no pull waits for the host to issue it.
        num_experts: the kernel stops (prints the id, traps: kernels/id_check.py) on an id of topk_ids[:n]
        outside [0, num_experts); None: only negative ids stop it. The torch ops do not check the ids."""
        if push_rows and self.ep_size > 32:  # the kernel's warps hold one rank's address per lane
            raise ValueError(f"mok_nn expert parallelism: push_rows takes at most 32 ranks, not {self.ep_size}")
        if not publish_kernel_ok(x):
            self.publish_torch(x, topk_ids, topk_weights, num_tokens, push_rows)
            if then_barrier:
                self.barrier()
            return
        if topk_weights.dtype != torch.float32:
            # the kernel takes fp32 weights: the bits copy_ into the fp32 section gives (bf16 / fp16 exact, fp64 rounded)
            topk_weights = topk_weights.float()
        tc, k = self.tokens_cap, topk_ids.shape[1]
        warp_jobs = max(min(num_tokens, tc), -(-tc * k // 32))  # x rows (a warp each), id/weight elements (32 a warp)
        epoch = self._next_epoch() if then_barrier else 0
        cb._lib().launch("mok_ep_publish", x, topk_ids, topk_weights, self.local("tokens"),
                         self.section_table(("ids", "weights", "ntok")), self.rank, tc, num_tokens,
                         self._copy_grid(warp_jobs), self.section_addrs("pad"), self.err, self.arrivals, epoch,
                         timeout_us(self.timeout_s), self.section_addrs("tokens"), int(push_rows),
                         2**31 - 1 if num_experts is None else num_experts, stream=cb._stream())

    def publish_torch(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                      num_tokens: int, push_rows: bool = False) -> None:
        """publish with torch ops (about 4 + 4P launches; push_rows: P - 1 more): the stores mok_ep_publish's
        contract names, bit for bit."""
        P, r, tc, top_k = self.ep_size, self.rank, self.tokens_cap, topk_ids.shape[1]
        n = min(num_tokens, tc)
        self.local("tokens")[r * tc:r * tc + n].copy_(x[:n])
        if push_rows:
            self.copy_to_peers("tokens", x, n)
        own_ids = self.local("ids")[r]  # own row first, then copied to the peers from there
        own_ids[:n].copy_(topk_ids[:n])
        if n < tc:
            own_ids[n:].fill_(-1)
        w = topk_weights[:n].detach()
        w_own = slice(r * tc * top_k, (r * tc + n) * top_k)
        for p in range(P):
            if p != r:
                self.peer(p, "ids")[r].copy_(own_ids)
            self.peer(p, "weights")[w_own].view(n, top_k).copy_(w)  # fp32 by the copy (same bits as .float())
            self.peer(p, "ntok")[r:r + 1].fill_(num_tokens)

    def _next_epoch(self) -> int:
        """The epoch of the next barrier (they only grow: a pad slot is never reset)."""
        self.epoch += 1
        if self.epoch >= 2**31 - 1:
            raise EPError("symmetric-memory barrier epoch overflow; create a new workspace")
        return self.epoch

    def barrier(self) -> None:
        """Every rank reaches this point of its stream; unicast release/acquire with each peer."""
        self._next_epoch()
        wait_us = timeout_us(self.timeout_s)
        pad = self.local("pad")
        for p in range(self.ep_size):
            if p == self.rank:
                continue
            peer_slot = self.peer(p, "pad")[self.rank:self.rank + 1]
            cb._lib().launch("mok_ep_signal", peer_slot, pad[p:p + 1], self.err, self.epoch, wait_us,
                             stream=cb._stream())

    def num_sms(self) -> int:
        if getattr(self, "_num_sms", None) is None:
            self._num_sms = cb.num_sms(self.err.device)
        return self._num_sms

    def _copy_grid(self, num_rows: int) -> int:
        return copy_grid(num_rows, self.num_sms())

    @staticmethod
    def copy_rows_torch(src, src_idx, dst, dst_idx) -> None:
        """dst[dst_idx[i]] = src[src_idx[i]] where both are >= 0 (dst indices unique), by torch indexing
        (MOK_EP_COPY=torch: synchronises with the host)."""
        ok = (src_idx >= 0) & (dst_idx >= 0)
        dst[dst_idx[ok]] = src[src_idx[ok]]

    def pull_rows(self, name: str, pull_src: torch.Tensor) -> None:
        """Row pull_src[p, t] (>= 0) of rank p's section `name` into row p*Tc + t of the local one,
        for every peer p (pull_src [P, Tc]; the own rank's entries are -1): one mok_ep_pull_peers launch."""
        P, tc = self.ep_size, self.tokens_cap
        if copy_mode() == "kernel":
            cb._lib().launch("mok_ep_pull_peers", self.section_addrs(name), pull_src, self.local(name),
                             self._copy_grid(P * tc), stream=cb._stream())
            return
        dst_rows = _cached("arange", P * tc, self.err.device).view(P, tc)
        for p in range(P):
            if p != self.rank:
                self.copy_rows_torch(self.peer(p, name), pull_src[p], self.local(name), dst_rows[p])

    def push_rows(self, rows: torch.Tensor, name: str, row_rank: torch.Tensor, row_slot: torch.Tensor) -> None:
        """Row r of rows into row row_slot[r] of rank row_rank[r]'s section `name` (own rank included;
        -1: not sent): one mok_ep_push_peers launch (the torch copies: one per rank, push_split)."""
        if copy_mode() == "kernel":
            cb._lib().launch("mok_ep_push_peers", rows, self.section_addrs(name), row_rank, row_slot,
                             self._copy_grid(rows.shape[0]), stream=cb._stream())
            return
        push_src = push_split(row_rank, self.ep_size)
        for p in range(self.ep_size):
            self.copy_rows_torch(rows, push_src[p], self.peer(p, name), row_slot)

    def push_partials(self, rows: torch.Tensor, eps: "EPSchedule", num_experts: int, weighted: bool,
                      ids_all: torch.Tensor | None = None, copy_stream: torch.cuda.Stream | None = None) -> None:
        """Into every source s's partials[rank, t]: this rank's node of token (s, t)'s combine tree,
        from the rows of its slots routed here (times the all-gathered top-k weight if weighted);
        tokens without a slot here get nothing (the source knows it from its ids).

        ids_all: the all-gathered ids of the step that built eps (default: the ids section, which holds
        them only until the next forward on this workspace publishes; the backward passes its forward's
        copy, EPSaved.ids_all).
        copy_stream: the kernel writes the nodes for the other ranks into a local staging block each
        (its own ones straight into its own partials section), and copy_stream sends each block whole
        to its source (one copy each: the GPU's copy engines, no SMs), so the current stream goes on
        at once; the caller waits for copy_stream before the barrier. Rows of tokens without a slot
        here travel too but are never read."""
        assert eps.slot_row is not None, "the per-rank sums need EPSchedule.slot_row"
        ids_all = self.local("ids") if ids_all is None else ids_all
        args = (rows, eps.slot_row, self.local("weights"), ids_all)
        scalars = (self.rank, num_experts // self.ep_size, cb.experts_per_leaf(num_experts), int(weighted))
        if _sums_in_torch(rows):
            for s, (node, present) in enumerate(partial_sums_torch(*args, *scalars)):
                self.peer(s, "partials")[self.rank][present] = node[present]
            return
        if copy_stream is None:
            cb._lib().launch("mok_ep_partial_push", *args, self.section_addrs("partials"), *scalars,
                             self.rank * self.tokens_cap, stream=cb._stream())
            return
        P, r, tc, dev = self.ep_size, self.rank, self.tokens_cap, rows.device
        block = tc * self.hidden * 4  # bytes of one source's nodes
        staging = torch.empty(P - 1, tc, self.hidden, dtype=torch.float32, device=dev)
        # source s < r -> staging block s, s > r -> block s - 1, s == r -> own partials[r] (row 0 of it)
        src = _cached("arange", P, dev)
        bases = torch.where(src == r, self.local("partials")[r].data_ptr(),
                            staging.data_ptr() + (src - (src > r).long()) * block)
        cb._lib().launch("mok_ep_partial_push", *args, bases, *scalars, 0, stream=cb._stream())
        copy_stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(copy_stream):
            for s in range(P):
                if s != r:
                    self.peer(s, "partials")[r].copy_(staging[s - (s > r)], non_blocking=True)
        staging.record_stream(copy_stream)

    def final_combine(self, topk_ids: torch.Tensor, flags: torch.Tensor, num_experts: int, out_dtype) -> torch.Tensor:
        """out[t] = the top of token t's combine tree over the ranks' nodes in partials[:, t]; NaN rows
        where any flag is set (the step's errors)."""
        parts, ids = self.local("partials"), topk_ids.contiguous()
        scalars = (num_experts // self.ep_size, cb.experts_per_leaf(num_experts))
        if _sums_in_torch(parts):
            return final_combine_torch(parts, ids, flags, *scalars).to(out_dtype)
        out = torch.empty(ids.shape[0], self.hidden, dtype=out_dtype, device=parts.device)
        if ids.shape[0]:
            cb._lib().launch("mok_combine_final", parts, ids, flags, out, *scalars, stream=cb._stream())
        return out


def _sums_in_torch(t: torch.Tensor) -> bool:
    """The combine's per-rank sums by torch stand-ins: only in the CPU simulation (MOK_EP_COPY=torch on
    CPU tensors). On the GPU the kernels always run (their fused multiply-adds give the EP = 1 bits;
    torch's separate multiply and add would not), whatever MOK_EP_COPY says about the row copies."""
    return copy_mode() == "torch" and not t.is_cuda


def partial_sums_torch(rows, slot_row, w_all, ids_all, rank, experts_per_rank, experts_per_leaf, weighted) -> list:
    """mok_ep_partial_push's contract in torch (CPU simulation): per source s, (node [Tc, H] fp32,
    present [Tc] bool) of this rank's block of each token's combine tree."""
    P, tc, k = ids_all.shape
    slot_row = slot_row.view(P, tc, k)
    w_all = w_all[:P * tc * k].view(P, tc, k)
    out = []
    for s in range(P):
        ids = ids_all[s]
        use = (ids >= 0) & (ids // experts_per_rank == rank) & (slot_row[s] < rows.shape[0])
        safe = torch.where(use, slot_row[s], 0)
        w = w_all[s] if weighted else torch.ones_like(w_all[s])
        vals, present = cb.leaf_sums_torch(lambda j: rows[safe[:, j]], w, ids // experts_per_leaf, use)
        out.append(cb.tree_sum_torch(vals, present))
    return out


def final_combine_torch(parts, ids, flags, experts_per_rank, experts_per_leaf) -> torch.Tensor:
    """mok_combine_final's contract in torch: [T, H] fp32, the tree over the ranks' nodes parts[q, t]
    (rank q's at leaf q * leaves per rank, present where a slot of t went to rank q), NaN if any flag."""
    n, per_rank = ids.shape[0], experts_per_rank // experts_per_leaf
    vals = [parts.new_zeros(n, parts.shape[2]) for _ in range(cb.COMBINE_LEAVES)]
    present = [torch.zeros(n, dtype=torch.bool, device=parts.device)] * cb.COMBINE_LEAVES
    for q in range(parts.shape[0]):
        vals[q * per_rank] = parts[q, :n]
        present[q * per_rank] = (ids // experts_per_rank == q).any(dim=1)
    return _poison(cb.tree_sum_torch(vals, present)[0], flags.any())


# --------------------------------------------------------------------------
# workspace, errors


def unsupported_reason(layer) -> str | None:
    """None where the symmetric-memory EP path can run this layer's group, else why not."""
    try:
        import torch.distributed._symmetric_memory  # noqa: F401
    except ImportError as err:
        return f"torch symmetric memory is unavailable ({err})"
    if not dist.is_initialized() or dist.get_backend(layer.ep_group) != "nccl":
        return "expert parallelism on CUDA needs an NCCL ep_group"
    if layer.ep_size > torch.cuda.device_count():
        return (f"ep_group spans {layer.ep_size} ranks but this host sees {torch.cuda.device_count()} GPUs; "
                "the EP kernels work inside one NVLink domain")
    hosts = distributed.group_hosts(layer.ep_group)
    if len(hosts) > 1:
        return (f"ep_group spans {len(hosts)} hosts ({', '.join(hosts[:4])}{', ...' if len(hosts) > 4 else ''}); "
                "the EP kernels work inside one NVLink domain")
    if layer.hidden_size % 8:
        return "expert parallelism on CUDA needs hidden_size % 8 == 0"
    return None


_SHAPE_FIELDS = ["hidden_size", "intermediate_size", "num_experts", "top_k", "dtype", "activation", "swiglu_limit",
                 "ep_size", "config"]


def _shape_row(ws) -> list[int]:
    import zlib

    def h(v):
        return zlib.crc32(repr(v).encode()) & 0x7FFFFFFF

    return [ws.hidden_size, ws.intermediate_size, ws.num_experts, ws.top_k, h(ws.dtype), h(ws.activation),
            h(ws.swiglu_limit), ws.ep_size, h(ws.config)]


def _all_gather_ints(values: list[int], group, device) -> list[list[int]]:
    t = torch.tensor(values, dtype=torch.int64, device=device)
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t, group=group)
    return [o.tolist() for o in out]


def init_workspace(ws) -> None:
    """Collective: every rank of ws.ep_group checks that all agree on the shapes (creation time only)."""
    if ws.num_experts % ws.ep_size:
        raise ValueError(f"num_experts ({ws.num_experts}) must be divisible by the EP size ({ws.ep_size})")
    if ws.hidden_size % 8:
        raise ValueError("expert parallelism on CUDA needs hidden_size % 8 == 0")
    check_group_shapes(_shape_row(ws), _all_gather_ints(_shape_row(ws), ws.ep_group, ws.device), _SHAPE_FIELDS)
    ws.buffers.pop("ep_symm", None)
    ws.ep_state = {"bufs": None, "pending": []}


def _recreate(ws, tokens_cap: int) -> None:
    """Collective: replace the symmetric buffer by one for tokens_cap tokens per rank."""
    st = ws.ep_state
    _SCHED_GRAPHS.clear()  # they read the old buffer's ids section
    if st["bufs"] is not None:
        # Every rank's queued work, and so every peer's access to this rank's old buffer, is
        # done before the old buffer is freed.
        torch.cuda.synchronize(ws.device)
        dist.barrier(group=ws.ep_group)
        st["bufs"] = None
        ws.buffers.pop("ep_symm", None)
    st["bufs"] = SymmBuffers.create(ws.ep_group, tokens_cap, ws.hidden_size, ws.top_k, ws.device)
    ws.buffers["ep_symm"] = st["bufs"].raw


def reserve_tokens(ws, num_tokens: int) -> int:
    """Collective over ws.ep_group (every rank, same call): token capacity >= the largest num_tokens
    of any rank; re-creates the buffer if needed (between steps only). Returns the capacity."""
    st = ws.ep_state
    tc = max(max(max(r) for r in _all_gather_ints([num_tokens], ws.ep_group, ws.device)), 1)
    if st["bufs"] is None or tc > st["bufs"].tokens_cap:
        _recreate(ws, tc)
    return st["bufs"].tokens_cap


def reserve_pass(ws, num_tokens: int) -> None:
    """Before the macrobatch passes of one call (autograd.macrobatch_passes, on every rank alike): a
    capacity below a pass grows to it now (collective: the capacity is the same on every rank, so
    every rank takes this branch), instead of every pass being flagged and raising on one rank
    before another. A workspace without a buffer yet gets it from its first pass."""
    bufs = ws.ep_state.get("bufs")
    if bufs is not None and bufs.tokens_cap < num_tokens:
        reserve_tokens(ws, num_tokens)


def _buffers(ws, num_tokens: int) -> SymmBuffers:
    st = ws.ep_state
    if st["bufs"] is None:
        reserve_tokens(ws, num_tokens)  # first call: the largest first batch of any rank
    elif st.get("grow_to", 0) > st["bufs"].tokens_cap:
        # Every rank raised the same EPError (a batch above the capacity, counts seen by all
        # ranks in the same step), so every rank grows here, in the same call.
        _recreate(ws, st["grow_to"])
    return st["bufs"]


def _record_errors(ws, flags: torch.Tensor, what: str) -> None:
    """The step's flags [3] to pinned host memory, then an arrival marker (host[3] = 1) by a second copy
    behind them on the stream: check_errors' non-blocking poll reads the marker, with no CUDA call (an
    event query at the start of every EP call cost ~20 us of host time there, before the first launch)."""
    host = torch.zeros(flags.shape[0] + 1, dtype=flags.dtype, pin_memory=True)
    host[:-1].copy_(flags, non_blocking=True)
    host[-1:].copy_(_cached("ones", 1, flags.device, flags.dtype), non_blocking=True)
    ev = torch.cuda.Event()
    ev.record()
    # check_errors reads it through a numpy view of the same memory: a tensor index and int() cost the
    # host ~10 us each there, before the next call's first launch
    ws.ep_state["pending"].append((host.numpy(), ev, what))
    # the steps check_errors found done, freed here, after this step's launches: freeing an event and a
    # pinned block costs the host driver calls, which at the start of the next call would delay its first launch
    ws.ep_state.get("retired", []).clear()


def check_errors(ws, block: bool = True) -> None:
    """Raise EPError for any finished EP step of this workspace that flagged an error.

    block=True waits for all of them (tests, end of a step); block=False only looks at finished ones.
    """
    st = getattr(ws, "ep_state", None)
    if not st:
        return
    keep = []
    for host, ev, what in st["pending"]:
        if block:
            ev.synchronize()
        # the marker first (_record_errors), then the flags: the marker's copy starts after the flags'
        # copy is done (one stream), so flags read after the marker are the step's
        if host[3] != 1:  # not arrived yet (host: a numpy view of the pinned flags)
            assert not block, "flags copied before the event they are recorded with"
            keep.append((host, ev, what))
            continue
        overflow, timeout, too_many = (int(v) for v in host[:3])
        st.setdefault("retired", []).append((host, ev))  # freed after the caller's launches (_record_errors)
        if overflow or timeout or too_many:
            st["pending"] = []
            if too_many:
                st["grow_to"] = max(st.get("grow_to", 0), too_many)
                raise EPError(
                    f"mok_nn expert parallelism ({what}): a rank called the layer with {too_many} tokens, above "
                    f"the workspace's token capacity {st['bufs'].tokens_cap}. The step's outputs are NaN; the next "
                    f"forward on every rank re-creates the buffer for {too_many} tokens (call check_errors(ws) on "
                    f"every rank so that all raise this at the same point, or reserve_tokens(ws, n) beforehand).")
            if overflow:
                raise EPError(
                    f"mok_nn expert parallelism ({what}): the routing overflowed the expert buffers of a rank "
                    f"(schedule capacity {st.get('capacity')} rows); raise MoKConfig.schedule_capacity_multiplier "
                    f"(now {ws.config.schedule_capacity_multiplier}). The step's outputs are NaN.")
            raise EPError(
                f"mok_nn expert parallelism ({what}): a peer rank did not reach the barrier within "
                f"{st['bufs'].timeout_s:g} s (did every rank call the layer?). The outputs are NaN; the "
                f"workspace is unusable.")
    st["pending"] = keep


# --------------------------------------------------------------------------
# forward / backward


@dataclass
class EPSaved:
    eps: EPSchedule
    gate_up: torch.Tensor  # [cap, 2I] bf16
    w_rows: torch.Tensor  # [cap] fp32, top-k weight of each row (0 on padding)
    num_tokens: int
    bufs: SymmBuffers  # the buffer the schedule indexes (the backward must use the same one)
    too_many: torch.Tensor  # [] int32 of _too_many in the forward: the backward has the same token counts
    # [cap, H] bf16 x rows in schedule order, for the weight gradient of gate_up_proj: kept, as the
    # single-GPU path keeps them (pulling and gathering them again would cost deepseek-v3 at 8192 tokens per
    # rank 1.3 ms of the backward, against ~2 GB)
    x_rows: torch.Tensor
    # [P, Tc, k] int64: the forward's all-gathered ids, for the backward's per-rank d x sums. A copy, taken
    # between the forward's two barriers: the ids section belongs to the workspace, and the next forward
    # on it (another layer with the same shapes) publishes its own routing there.
    ids_all: torch.Tensor


def _pad_nan(t: torch.Tensor, rows: int) -> torch.Tensor:
    """t with NaN rows appended up to `rows` (tokens above the capacity: the step is flagged)."""
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_full((rows - t.shape[0],) + tuple(t.shape[1:]), float("nan"))])


def _too_many(bufs: SymmBuffers) -> torch.Tensor:
    """[] int32: the largest token count of this call if some rank's exceeds the capacity, else 0.
    Read between the first and the second barrier: a peer writes its next call's count only
    after the second."""
    most = bufs.local("ntok").max()
    return torch.where(most > bufs.tokens_cap, most, 0)


def _step_flags(eps: EPSchedule, bufs: SymmBuffers, too_many: torch.Tensor) -> torch.Tensor:
    """[overflow, barrier timeout, too_many]: any non-zero entry poisons the step."""
    return torch.stack([eps.overflow.to(torch.int32), bufs.err[0], too_many])


def _poison(t: torch.Tensor, bad: torch.Tensor) -> torch.Tensor:
    """t, or NaN everywhere if bad (= flags.any(): the outputs show the error). A select, not an
    added 0.0: -0.0 stays -0.0, the bits equal the EP = 1 path's."""
    return torch.where(bad, float("nan"), t)


def forward(x, topk_ids, topk_weights, params, schedule, ws):
    check_errors(ws, block=False)
    gate_up_proj, down_proj, gate_up_bias, down_bias = params.as_args()
    why = cb.check_supported(x, topk_ids, gate_up_proj, down_proj, ws.activation)
    if why is not None:
        raise RuntimeError(f"mok_nn CUDA backend: {why}")
    num_tokens, top_k = topk_ids.shape
    bufs = _buffers(ws, num_tokens)
    P, tc = bufs.ep_size, bufs.tokens_cap
    e_l = ws.num_experts // P
    cap = schedule_capacity(tc, top_k, e_l, P, ws.config.schedule_capacity_multiplier)
    ws.ep_state["capacity"] = cap
    n = min(num_tokens, tc)  # above the capacity: the first tc tokens take part, the step is flagged

    # 4. dispatch (token_rows_mode): scatter where every peer needs nearly every row and the kernel can run
    # (else each rank pushes its rows to every peer in step 1, or they are pulled after the barrier, beside
    # the schedule); otherwise the rows the local experts need, pulled after the schedule
    dispatch = token_rows_mode(ws.num_experts, P, top_k)
    if dispatch == "scatter" and not scatter_from_ranks_ok(x, top_k):
        dispatch = "push" if P <= 32 else "all"  # (the same rows, moved before the barrier)
    # 1. own rows local (push: to every rank); ids, weights and token count to every rank (unicast stores
    # into peer memory), 2. and the barrier (in the same launch)
    bufs.publish(x, topk_ids, topk_weights, num_tokens, then_barrier=True, push_rows=dispatch == "push",
                 num_experts=ws.num_experts)
    tokens = bufs.local("tokens")
    pull = None
    if dispatch == "all":
        pull = ("all", lambda: bufs.pull_rows("tokens", _pull_table(P, tc, bufs.rank, x.device)))
    elif dispatch == "needed":
        pull = ("needed", lambda eps: bufs.pull_rows("tokens", eps.pull_src))
    # 3. schedule from everyone's routing, with the pull (only what the GEMMs need before their launch:
    # every torch op issued before the first GEMM delays the GPU, which waits for the host here)
    eps = ep_schedule(bufs.local("ids"), n, bufs.rank, e_l, cap, pull)
    sched = eps.sched
    # 4. the rows in the GEMM's order; 5. experts
    x_rows = scatter_from_ranks(bufs, eps, "tokens") if dispatch == "scatter" else eps.gather_rows(tokens)
    h = None
    if cb.use_fused_act(down_proj.shape[2], ws.activation, gate_up_bias is not None, x.shape[1]):
        # the activation in the gate/up GEMM's epilogue (as at EP = 1: the same bits either way)
        gate_up, h = cb.gate_up_act(x_rows, gate_up_proj, sched, ws.activation, ws.swiglu_limit)
    else:
        gate_up = cb.grouped_gemm(x_rows, gate_up_proj, sched, transpose_w=False)
    too_many = _too_many(bufs)  # between the two barriers (stream order), as _too_many requires
    # the routing of this step for the backward's per-rank d x sums: copied here, between the two
    # barriers, as a peer publishes its next call's ids into this section only after the second
    ids_all = bufs.local("ids").clone()
    w_rows = bufs.local("weights").index_select(0, eps.row_gslot)  # padding: the zero last element
    if gate_up_bias is not None:
        gate_up = (gate_up.float() + cb.bias_rows(gate_up_bias, sched)).to(x.dtype)
    if h is None:
        h = cb.act_forward(gate_up, sched, ws.activation, ws.swiglu_limit)
    gemm_push = down_push(h, down_bias is not None)
    sums = "slot" if gemm_push else combine_sums(ws.num_experts, P, top_k)
    if gemm_push:
        # 5c. + 6. down GEMM whose idle producer warps send each row to its source's slots as tiles finish
        cb.grouped_gemm_push(h, down_proj, sched, bufs.section_addrs("slots"), eps.row_src, eps.row_slot)
    else:
        out_rows = cb.grouped_gemm(h, down_proj, sched, transpose_w=False)
        if down_bias is not None:
            out_rows = (out_rows.float() + cb.bias_rows(down_bias, sched)).to(x.dtype)
        # 6. combine push into each source's partials (one fp32 node per token) or slots (a row per slot)
        if sums == "rank":
            bufs.push_partials(out_rows, eps, ws.num_experts, weighted=True)
        else:
            bufs.push_rows(out_rows, "slots", eps.row_src, eps.row_slot)
    # 7.
    bufs.barrier()
    # 8. fixed-order combine on the source
    flags = _step_flags(eps, bufs, too_many)
    if sums == "rank":
        y = _pad_nan(bufs.final_combine(topk_ids[:n], flags, ws.num_experts, x.dtype), num_tokens)
    else:
        w_eff = _poison(topk_weights[:n].float(), flags.any())
        y = _pad_nan(cb.combine(bufs.local("slots"), sched.pos, w_eff, topk_ids[:n], ws.num_experts, x.dtype),
                     num_tokens)
    _record_errors(ws, flags, "forward")
    # the schedule the backward reads, on tensors of its own (taken here, after the launches: see kept)
    return y, EPSaved(eps.kept(), gate_up, w_rows, num_tokens, bufs, too_many, x_rows, ids_all)


def _copy_stream(ws, dev) -> torch.cuda.Stream:
    """The side stream of the copy-engine sends (one per workspace)."""
    st = ws.ep_state
    if "copy_stream" not in st:
        st["copy_stream"] = torch.cuda.Stream(device=dev)
    return st["copy_stream"]


def scatter_from_ranks_ok(rows: torch.Tensor, top_k: int) -> bool:
    """mok_scatter_rows_peers can run (token_rows_mode / dy_rows_mode 'scatter'): on the GPU, bf16 rows of 16-byte
    vectors (H % 8 == 0), k <= 32 (a lane per slot). Only facts every rank shares: a rank that fell back to
    pushing while a peer scattered would read rows that peer never sent (the kernel reads the sections,
    never `rows` itself, so its layout does not matter)."""
    return _on_cuda(rows) and rows.dtype == torch.bfloat16 and rows.shape[-1] % 8 == 0 and top_k <= 32


def scatter_from_ranks(bufs: SymmBuffers, eps: EPSchedule, section: str, skip_tail: bool = True) -> torch.Tensor:
    """eps.gather_rows of `section` ("tokens" or "dy") where each rank's rows are only in that rank's own
    section (nothing was pushed or pulled): one mok_scatter_rows_peers launch reads token row t of rank p from
    rank p's section (over NVLink for a peer), once, and stores it to each of its rows here. Returns
    [capacity, H]; the same rows as gather_rows over a section holding every rank's rows. A peer writes its own
    rows again only in its next step's publish (or backward), after this step's second barrier, which this
    rank reaches only after this launch."""
    local = bufs.local(section)
    slots = eps.token_slots()
    assert slots.shape[0] == bufs.ep_size * bufs.tokens_cap  # the kernel's units: P*Tc source rows
    out = torch.empty(eps.sched.row_token.shape[0], local.shape[1], dtype=local.dtype, device=local.device)
    if not out.shape[0]:
        return out
    tiles = eps.sched.tile_expert if skip_tail else cb._cached_zero_tile(local.device)
    grid = cb._scatter_rows_grid(slots.shape[0], out.shape[0], bufs.num_sms())
    cb._lib().launch("mok_scatter_rows_peers", local, bufs.section_addrs(section), slots, eps.sched.row_token, tiles,
                     out, grid, stream=cb._stream())
    return out


def backward(grad_y, saved: EPSaved, x, topk_ids, topk_weights, params, ws, grads_into=None, needs=None,
             consume_saved=False):
    """needs: which parameter gradients to compute (reference.param_grads_needed; None: all). consume_saved:
    nothing reads saved after this call (autograd keeps no graph), so d gate_up overwrites saved.gate_up."""
    from . import reference

    check_errors(ws, block=False)
    _, _, need_b13, need_b2 = reference.param_grads_needed(needs)
    gate_up_proj, down_proj, gate_up_bias, down_bias = params.as_args()
    num_tokens, top_k = topk_ids.shape
    bufs = saved.bufs
    if ws.ep_state["bufs"] is not bufs:
        raise EPError("mok_nn expert parallelism: the workspace's buffer was re-created between this forward "
                      "and its backward (a larger batch, or reserve_tokens); run the step again")
    P, r, tc = bufs.ep_size, bufs.rank, bufs.tokens_cap
    eps, sched, gate_up = saved.eps, saved.eps.sched, saved.gate_up
    n = min(num_tokens, tc)

    # 1. own dy rows local (the forward kept its x rows)
    dy = bufs.local("dy")
    x_rows = saved.x_rows
    dy[r * tc:r * tc + n].copy_(grad_y[:n])
    # (dy_rows_mode 'push': into every peer's section as well, before the barrier, so no pull follows it; a peer
    # reads its section only between the barriers of a step, so the rows written here cannot be in use)
    dy_mode = dy_rows_mode(ws.num_experts, P, top_k)
    # (asked of the dy section the kernel reads, bf16 on every rank, not of grad_y: a direct caller of this
    # function may pass another dtype on one rank only, and that rank alone would then push)
    if dy_mode == "scatter" and not scatter_from_ranks_ok(dy, top_k):
        dy_mode = "push"
    if dy_mode == "push":
        bufs.copy_to_peers("dy", grad_y, n)
    # 2. (the token counts are the forward's: its too-many verdict holds, ntok is not rewritten)
    bufs.barrier()
    # 3. reverse combine: the dy rows in the GEMMs' row order (pulled first, or read from the peers' sections)
    if dy_mode == "pull":
        bufs.pull_rows("dy", eps.pull_src)
    skip_tail = down_bias is None  # (the down bias sums every row)
    if dy_mode == "scatter":
        dy_rows = scatter_from_ranks(bufs, eps, "dy", skip_tail)
    else:
        dy_rows = eps.gather_rows(dy, skip_tail=skip_tail)
    # 4. dgrad, dSwiGLU, top-k weight gradient, weight gradients (all local)
    dgu, wh, dw_rows = cb.dgrad_down_act([dy_rows], down_proj, gate_up, saved.w_rows, sched, ws.activation,
                                         ws.swiglu_limit, in_place=consume_saved)
    if down_bias is not None:
        dw_rows = dw_rows + (dy_rows.float() * cb.bias_rows(down_bias, sched)).sum(dim=1)
    dx_mode = dx_push_mode(x.shape[1])
    dx_rows = None  # (stays None where the dgrad GEMM sends the rows: the returned grads' grad_rows too)
    copy_engine = False
    if dx_mode == "gemm" and _gemm_push_ok(dgu):
        # 4b + 5. the dgrad of gate/up sends each d x row to its source's dxslots as tiles finish
        sums = "slot"
        cb.grouped_gemm_push(dgu, gate_up_proj, sched, bufs.section_addrs("dxslots"), eps.row_src, eps.row_slot,
                             transpose_w=True)
    else:
        dx_rows = cb.grouped_gemm(dgu, gate_up_proj, sched, transpose_w=True)
        # 5a. (per-rank sums) d x sums now, sent by the copy engines while the weight gradients below run on
        # every SM (on the GPU; the CPU simulation stores them after the weight gradients)
        copy_engine = dx_rows.is_cuda
        sums = combine_sums(ws.num_experts, P, top_k, hidden=copy_engine)
    dx_stream = None
    if sums == "rank" and copy_engine:
        dx_stream = _copy_stream(ws, dx_rows.device)
        bufs.push_partials(dx_rows, eps, ws.num_experts, weighted=False, ids_all=saved.ids_all,
                           copy_stream=dx_stream)
    d_down_bias = None
    if down_bias is not None and need_b2:
        wd = (saved.w_rows.unsqueeze(1) * dy_rows.float()).to(x.dtype)
        d_down_bias = cb.segment_sum(wd, sched).to(down_bias.dtype)
    d_gate_up_bias = None if gate_up_bias is None or not need_b13 else cb.segment_sum(dgu, sched).to(gate_up_bias.dtype)
    # the weight gradients as at EP = 1 (MOK_GEMM=torch: torch._grouped_mm; grads_into: added to it; frozen: none)
    grads = cb.param_grads(dy_rows, wh, dgu, x_rows, sched, gate_up_proj.dtype, dx_rows, dw_rows, d_gate_up_bias,
                           d_down_bias, grads_into, needs)
    # 5. reverse dispatch: push d x rows into the source slots; d w as one dense row per source
    # into this rank's row of the source's dwslots. The source reads only the slots this rank
    # computed (gather by owner below), so the others are left unwritten (no zero fill).
    # Rows without a slot (padding, past the segments) scatter to scratch elements, one each:
    # no index repeats, every element is written at most once.
    n_slots = P * tc * top_k
    idx = torch.where(eps.row_src >= 0, eps.row_gslot, n_slots + _cached("arange", dw_rows.numel(), x.device))
    dw_dense = dw_rows.new_empty(n_slots + dw_rows.numel()).scatter_(0, idx, dw_rows)
    dw_dense = dw_dense[:n_slots].view(P, tc * top_k)
    if sums == "slot":
        if dx_rows is not None:  # (else the dgrad GEMM sent them)
            bufs.push_rows(dx_rows, "dxslots", eps.row_src, eps.row_slot)
    elif dx_stream is None:
        bufs.push_partials(dx_rows, eps, ws.num_experts, weighted=False, ids_all=saved.ids_all)
    for p in range(P):
        bufs.peer(p, "dwslots")[r].copy_(dw_dense[p])
    if dx_stream is not None:
        torch.cuda.current_stream(dx_rows.device).wait_stream(dx_stream)  # every d x block sent
    # 6.
    bufs.barrier()
    # 7. fixed-order sums on the source
    flags = _step_flags(eps, bufs, saved.too_many)
    bad = flags.any()
    if sums == "rank":
        dx = _pad_nan(bufs.final_combine(topk_ids[:n], flags, ws.num_experts, x.dtype), num_tokens)
    else:
        ones = _poison(_cached("ones", n * top_k, x.device, torch.float32).view(n, top_k), bad)
        dx = _pad_nan(cb.combine(bufs.local("dxslots"), sched.pos, ones, topk_ids[:n], ws.num_experts, x.dtype),
                      num_tokens)
    owner = (topk_ids[:n] // (ws.num_experts // P)).reshape(1, -1)  # the rank that computed slot (t, j)
    dw_src = bufs.local("dwslots")[:, :n * top_k].gather(0, owner)
    d_topk = _pad_nan(_poison(dw_src.view(n, top_k), bad).to(topk_weights.dtype), num_tokens)
    _record_errors(ws, flags, "backward")
    return dx, d_topk, grads
