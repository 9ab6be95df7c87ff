"""Expert-parallel groups and the reference all-to-all (any torch.distributed backend).

The routed-expert math over these lives in reference.py (DispatchPlan).

"""

from __future__ import annotations

import socket
import weakref

import torch
import torch.distributed as dist


class EPError(RuntimeError):
    """An expert-parallel step that went wrong on the device (capacity overflow, a peer that never signalled,
    ...): its outputs are NaN, and the next call on the workspace or check_errors raises this."""


# group -> sorted host names of its ranks. Weak: a ProcessGroup kept alive past destroy_process_group and first
# freed at interpreter shutdown can abort the process (gloo's threads outlive the interpreter).
_HOSTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def group_hosts(group) -> list[str]:
    """The host names of the group's ranks, sorted, without repeats: one all_gather_object per group (collective:
    every rank of the group calls it at the same point), cached."""
    if group not in _HOSTS:
        names = [None] * dist.get_world_size(group)
        dist.all_gather_object(names, socket.gethostname(), group=group)
        _HOSTS[group] = sorted(set(names))
    return _HOSTS[group]


def group_size_and_rank(group) -> tuple[int, int]:
    if group is None:
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def all_to_all(tensor: torch.Tensor, send_splits: list[int], recv_splits: list[int], group) -> torch.Tensor:
    """all_to_all_single along dim 0; 16-bit floats travel as raw bytes (bit-exact on every backend)."""
    if group is None:
        return tensor
    send = tensor.contiguous()
    is16 = send.dtype in (torch.bfloat16, torch.float16)
    wire = send.unsqueeze(-1).view(torch.uint8) if is16 else send  # [..., 2] bytes: rows stay rows
    out = wire.new_empty((sum(recv_splits),) + tuple(wire.shape[1:]))
    dist.all_to_all_single(out, wire, recv_splits, send_splits, group=group)
    return out.view(send.dtype).squeeze(-1) if is16 else out


def exchange_counts(send_counts: torch.Tensor, group, signature: dict | None = None) -> torch.Tensor:
    """Each rank tells every peer how many rows it will send it. signature {name: int}: what every rank must
    agree on (sizes, dtype, ...), sent along with the counts in the same all-to-all; where a peer's differs,
    every rank concerned raises ValueError naming the field (a peer with another dtype or size would otherwise
    receive rows it misreads: the rows travel as raw bytes)."""
    if group is None:
        return send_counts
    sig = list((signature or {}).items())
    world = send_counts.shape[0]
    send = torch.cat([send_counts.view(world, 1),
                      torch.tensor([v for _, v in sig], dtype=send_counts.dtype).to(send_counts.device).expand(world, -1)],
                     dim=1)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    if sig:
        theirs = recv[:, 1:].tolist()
        rank = dist.get_rank(group)
        for p, row in enumerate(theirs):
            bad = [(name, mine, other) for (name, mine), other in zip(sig, row) if mine != other]
            if bad:
                what = ", ".join(f"{name} {mine} here, {other} on rank {p}" for name, mine, other in bad)
                raise ValueError(f"mok_nn expert parallelism: the ranks of the group disagree ({what}); every rank "
                                 f"must run the layer with the same sizes, dtype and settings (this is rank {rank})")
    return recv[:, 0].contiguous()


def token_count_range(num_tokens: int, group, device) -> tuple[int, int]:
    """(smallest, largest) token count of this call over the group's ranks: one all-reduce, read on the
    host (a synchronisation). Macrobatching uses it: every rank must run the same passes."""
    if group is None:
        return num_tokens, num_tokens
    t = torch.tensor([num_tokens, -num_tokens], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    hi, neg_lo = t.tolist()
    return -neg_lo, hi
