"""Expert-parallel groups and the reference all-to-all (any torch.distributed backend).

The routed-expert math over these lives in reference.py (DispatchPlan).

"""

from __future__ import annotations

import torch
import torch.distributed as dist


def group_size_and_rank(group) -> tuple[int, int]:
    if group is None:
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def all_to_all(tensor: torch.Tensor, send_splits: list[int], recv_splits: list[int], group) -> torch.Tensor:
    """all_to_all_single along dim 0 (a byte copy: bit-exact for any dtype the backend takes)."""
    if group is None:
        return tensor
    send = tensor.contiguous()
    wire = send  # 16-bit floats go as they are: gloo rejects int16 ("Invalid scalar type")
    out = wire.new_empty((sum(recv_splits),) + tuple(send.shape[1:]))
    dist.all_to_all_single(out, wire, recv_splits, send_splits, group=group)
    return out.view(send.dtype) if wire is not send else out


def exchange_counts(send_counts: torch.Tensor, group) -> torch.Tensor:
    """Each rank tells every peer how many rows it will send it."""
    if group is None:
        return send_counts
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    return recv_counts
