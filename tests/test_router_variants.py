"""benchmarks/router_variants.py runs on CPU (in its own process) and finds the two top-k forms choosing the same
experts, as the layer's routing does; group-limited selection against its stable-sort definition."""

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_router_variants_agree_on_cpu():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "router_variants.py"), "--shapes", "tiny,deepseek-v3",
                          "--tokens", "96", "--device", "cpu", "--iters", "2"], cwd=ROOT,
                         env={"PYTHONPATH": str(ROOT), "PATH": ""}, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    recs = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert {(r["shape"], r["topk"]) for r in recs} == {(s, t) for s in ("tiny", "deepseek-v3") for t in ("keys", "sort")}
    for r in recs:
        assert r["gemm"] == "fp32" and r["same_ids_as_layer"] and r["tokens_with_other_experts"] == 0.0
        assert r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0


def test_group_limited_selection_is_the_sort_formula():
    """select_experts with expert groups against its definition written with the stable sort (a group's score: its
    two best scores summed, largest first): the same ids on scores with many ties, +-0, NaN and -inf."""
    import torch

    from mok_nn.router import select_experts, topk_by_sort

    g = torch.Generator().manual_seed(3)
    for tokens, experts, n_group, topk_group, k in ((200, 64, 8, 4, 8), (50, 16, 4, 2, 3), (30, 8, 8, 3, 2), (0, 16, 4, 2, 2)):
        s = torch.randint(-2, 3, (tokens, experts), generator=g).float() / 4
        s[::2] = torch.rand(s[::2].shape, generator=g)
        s[1::5, ::3] = -s[1::5, ::3]
        for value in (float("nan"), -float("inf")) if tokens else ():
            s.view(-1)[torch.randint(0, s.numel(), (s.numel() // 40,), generator=g)] = value
        grouped = s.view(tokens, n_group, experts // n_group)
        best = torch.sort(grouped, dim=-1, descending=True, stable=True).values
        group_scores = best[..., : min(2, experts // n_group)].sum(dim=-1)
        keep = topk_by_sort(group_scores, topk_group)
        mask = torch.zeros(tokens, n_group, dtype=torch.bool).scatter_(1, keep, True)
        masked = s.masked_fill(~mask.repeat_interleave(experts // n_group, dim=1), float("-inf"))
        assert torch.equal(select_experts(s, k, n_group, topk_group), topk_by_sort(masked, k))
