"""MoKConfig: the tuning knobs of the fused kernel path.

The knobs change speed and memory, never the function computed; macrobatch_size
changes how the expert gradients are summed (per pass, then over the passes),
so their last bits may differ from one pass. The reference path accepts and
validates them too, so a config can be written once and used on every backend.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, fields


@dataclass(frozen=True)
class MoKConfig:
    """Tuning knobs of the fused MoE kernels.

    fwd_num_comm_sms / bwd_num_comm_sms: SMs of the persistent forward /
        backward kernels given to token dispatch and combine (expert
        parallelism); the rest run the grouped GEMMs. 0 is allowed only
        without expert parallelism.
    minibatch_size: tokens per readiness unit; sets the granularity at which
        communication and compute overlap (not read yet, see below).
    macrobatch_size: tokens processed per kernel pass; bounds workspace memory.
        None means all tokens in one pass. Independent of minibatch_size (which
        is not read), so it may be smaller, e.g. MoKConfig(macrobatch_size=512).
    schedule_capacity_multiplier: capacity of each rank's expert buffers as a
        multiple of the balanced load (tokens * top_k / ep_size, padded); a
        routing that overflows it is reported as an error, never truncated.

    What is read today: macrobatch_size (every backend: MoKFunction runs the
    tokens in passes of that many, forward and backward; y, d x and d topk-weights
    keep their bits on the CUDA path, the expert gradients are summed over the
    passes in the parameters' dtype; with expert parallelism, where a call needs
    passes every rank must pass the same number of tokens, checked by one
    all-reduce per call; under torch.compile one custom-op call per pass, the
    expert gradients summed by autograd in its own order: with backend="aot_eager"
    the eager bits for up to two passes, within rounding for more; inductor also
    reorders the torch ops around the custom ops, so there it is within rounding
    anyway), schedule_capacity_multiplier (expert parallelism)
    and fwd_num_comm_sms (only the opt-in overlapped forward, MOK_EP_FWD=overlap;
    docs/ep.md). The readiness unit of that forward is one 128-row GEMM tile, not
    minibatch_size. bwd_num_comm_sms and minibatch_size are validated and kept for
    an overlapped backward and a readiness unit other than the GEMM tile, which
    do not exist yet: setting them changes nothing now.
    """

    fwd_num_comm_sms: int = 16
    bwd_num_comm_sms: int = 16
    minibatch_size: int = 1024
    macrobatch_size: int | None = None
    schedule_capacity_multiplier: float = 2.0

    def __post_init__(self) -> None:
        for name in ("fwd_num_comm_sms", "bwd_num_comm_sms", "minibatch_size", "macrobatch_size"):
            value = getattr(self, name)
            if value is None and name == "macrobatch_size":
                continue
            try:  # numpy integers too (anything with __index__), kept as int: the config is a cache key
                if isinstance(value, bool):
                    raise TypeError
                object.__setattr__(self, name, operator.index(value))
            except TypeError:
                what = "an int or None" if name == "macrobatch_size" else "an int"
                raise TypeError(f"MoKConfig.{name} must be {what}, got {type(value).__name__}") from None
        for name in ("fwd_num_comm_sms", "bwd_num_comm_sms"):
            value = getattr(self, name)
            if not 0 <= value <= 128:
                raise ValueError(f"MoKConfig.{name} must be in [0, 128], got {value}")
        if self.minibatch_size <= 0:
            raise ValueError(f"MoKConfig.minibatch_size must be positive, got {self.minibatch_size}")
        if self.macrobatch_size is not None:
            if self.macrobatch_size <= 0:
                raise ValueError(f"MoKConfig.macrobatch_size must be positive, got {self.macrobatch_size}")
        mult = self.schedule_capacity_multiplier
        if isinstance(mult, (bool, str, bytes)):
            raise TypeError("MoKConfig.schedule_capacity_multiplier must be a number")
        try:
            mult = float(mult)  # numpy floats too, kept as float
        except (TypeError, ValueError):
            raise TypeError("MoKConfig.schedule_capacity_multiplier must be a number") from None
        if not (mult >= 1.0 and math.isfinite(mult)):  # also rejects NaN and inf
            raise ValueError(f"MoKConfig.schedule_capacity_multiplier must be a finite number >= 1.0, got {mult}")
        object.__setattr__(self, "schedule_capacity_multiplier", mult)

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}
