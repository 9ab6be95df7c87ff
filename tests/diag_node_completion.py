"""Diagnostic (not a test; CPU only): when do a token's per-rank combine nodes become computable during the
EP down GEMM, for a given order of its row tiles? (docs/ep.md, thirteenth session: the design of per-rank
nodes streamed during the down GEMM.)

    python tests/diag_node_completion.py [P] [T] [E] [k]      (default: qwen3-30b-a3b at EP = 2)

Rank 0's rows are laid out as the EP schedule lays them out: per local expert, rows in (source rank, token)
order, padded to 128-row tiles. A token's node on this rank (the sum of its slots routed here) can be
computed once every tile holding one of its rows is done. Printed per tile order: the share of this rank's
tokens (own / of the peers) whose node is complete once a given fraction of the tiles is done, taking the
tiles as done one at a time in that order (the persistent GEMM runs ~132 at once, so this is the
coarse picture). Orders: 'expert-major' (today's static order: expert by expert) and 'progress' (tiles
sorted by the largest (token + 1) / T of their rows: the tiles of every expert advance together)."""

import math
import sys

import torch


def completion(P: int, T: int, E: int, k: int, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randn(P * T, E, generator=g).topk(k, dim=1).indices  # row u = s * T + t: token t of rank s
    e_l = E // P
    rows = {e: [] for e in range(e_l)}  # rank 0's local experts: rows in (source, token) order
    for u, e in zip(*torch.nonzero(ids < e_l, as_tuple=True)):
        rows[int(ids[u, e])].append(int(u))
    for r in rows.values():
        r.sort()
    tiles, key = [], {}
    for e, r in rows.items():
        frac = [(u % T + 1) / T for u in r]
        for j in range(math.ceil(len(r) / 128)):
            tiles.append((e, j))
            key[(e, j)] = max(frac[128 * j:128 * j + 128])
    for name, seq in (("expert-major", tiles), ("progress", sorted(tiles, key=lambda t: key[t]))):
        pos = {t: i for i, t in enumerate(seq)}
        done = torch.full((P * T,), -1.0)
        for e, r in rows.items():
            for i, u in enumerate(r):
                done[u] = max(float(done[u]), (pos[(e, i // 128)] + 1) / len(seq))
        for who, part in (("own", done[:T]), ("peers", done[T:])):
            d = part[part >= 0]
            shares = {q: round(float((d <= q).float().mean()), 3) for q in (0.25, 0.5, 0.7, 0.8, 0.9, 0.95)}
            print(f"{name:12s} {who:5s} tokens with their node complete, by share of tiles done: {shares}")


if __name__ == "__main__":
    args = [int(a) for a in sys.argv[1:]] + [2, 8192, 128, 8][len(sys.argv) - 1:]
    completion(*args[:4])
