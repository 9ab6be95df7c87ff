"""MoKConfig: the tuning knobs of the fused kernel path.

The knobs change speed and memory, never the function computed; macrobatch_size
changes how the expert gradients are summed (per pass, then over the passes),
so their last bits may differ from one pass. The reference path accepts and
validates them too, so a config can be written once and used on every backend.
"""

from __future__ import annotations

import math
import operator
import warnings
from dataclasses import dataclass, fields

RESERVED = {"fwd_num_comm_sms": 16, "bwd_num_comm_sms": 16, "minibatch_size": 1024}  # knob -> default


@dataclass(frozen=True)
class MoKConfig:
    """Tuning knobs of the fused MoE kernels.

    macrobatch_size: tokens processed per pass, forward and backward (every backend: MoKFunction runs the
        tokens in passes of that many); bounds workspace memory. None: all tokens in one pass. y, d x and
        d topk-weights keep their bits on the CUDA path; the expert gradients are summed over the passes in
        the parameters' dtype. With expert parallelism, where a call needs passes every rank must pass the
        same number of tokens (checked by one all-reduce per call). Under torch.compile one custom-op call
        per pass, the expert gradients summed by autograd in its own order: with backend="aot_eager" the
        eager bits for up to two passes, within rounding for more (inductor reorders the torch ops around
        the custom ops, so there it is within rounding anyway).
    schedule_capacity_multiplier: capacity of each rank's expert buffers as a multiple of the balanced load
        (tokens * top_k rows received per rank), with expert parallelism; a routing that overflows it is
        reported as an error (NaN outputs, raised by the next call or check_errors), never truncated. The
        portable backend (backend="torch") bounds each pair of ranks' exchange by its share,
        ceil(multiplier * Tc * top_k / ep_size) rows (docs/portable.md). None: no bound; the CUDA path sizes
        its buffers for the worst case, the portable backend exchanges exact split sizes, read on the host
        (one device-to-host copy of the counts per call).

    Reserved (validated, read by no kernel yet; a value other than the default warns that it changes
    nothing): fwd_num_comm_sms / bwd_num_comm_sms, the SMs a forward / backward that overlaps the token
    exchange with the GEMMs would give to communication, and minibatch_size, the readiness unit of such an
    overlap. The expert-parallel path exchanges tokens in steps of their own between the GEMMs
    (docs/ep.md), so these knobs have nothing to set.
    """

    fwd_num_comm_sms: int = 16
    bwd_num_comm_sms: int = 16
    minibatch_size: int = 1024
    macrobatch_size: int | None = None
    schedule_capacity_multiplier: float | None = 2.0

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
        if mult is None:  # no bound (see above)
            pass
        elif isinstance(mult, (bool, str, bytes)):
            raise TypeError("MoKConfig.schedule_capacity_multiplier must be a number")
        else:
            try:
                mult = float(mult)  # numpy floats too, kept as float
            except (TypeError, ValueError):
                raise TypeError("MoKConfig.schedule_capacity_multiplier must be a number or None") from None
            if not (mult >= 1.0 and math.isfinite(mult)):  # also rejects NaN and inf
                raise ValueError(f"MoKConfig.schedule_capacity_multiplier must be a finite number >= 1.0 or None, "
                                 f"got {mult}")
            object.__setattr__(self, "schedule_capacity_multiplier", mult)
        for name, default in RESERVED.items():
            if getattr(self, name) != default:
                warnings.warn(f"MoKConfig.{name} is reserved: no kernel reads it yet, so {getattr(self, name)} "
                              "changes nothing (see MoKConfig's docstring)", UserWarning, stacklevel=3)

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}
