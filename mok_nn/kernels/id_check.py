"""The one device-side check of the routing: expert ids must lie in [0, num_experts).

The kernels that read every id anyway (the schedule kernels; at EP > 1 the publish kernel, before any id
is used) check each one where it is loaded. An id outside the range would index per-expert counts out of
bounds and leave its slot without a row, which every later kernel reads or writes; raising a Python error
instead would need the ids on the host, a synchronisation per call. So the kernel prints the id and stops
with a trap: the launch fails ("unspecified launch failure" at the next synchronisation) and the CUDA
context with it, as with torch's own device-side index checks; nothing after it computes on the bad id.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op


MESSAGE = "mok_nn: expert id {} of slot {} (token * top_k + j) is outside [0, {})"


@dsl_user_op
def _trap(*, loc=None, ip=None) -> None:
    llvm.intr_trap(loc=loc, ip=ip)


@cute.jit
def check_expert_id(v: cutlass.Int64, slot: cutlass.Int32, num_experts: cutlass.Int32):
    """Print and trap unless 0 <= v < num_experts (v: the id of slot `slot` = token * top_k + j)."""
    if v < 0:
        cute.printf(MESSAGE, v, slot, num_experts)
        _trap()
    if v >= num_experts:
        cute.printf(MESSAGE, v, slot, num_experts)
        _trap()
