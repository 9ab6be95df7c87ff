"""Do two builds of mok_nn compute the same bits? Hashes y, dx and every parameter gradient of one seeded
forward+backward of MoKMoELayer for a fixed list of configurations that cover the GPU paths.

    python benchmarks/fingerprint.py --out new.json                 # on the GPU, backend="cuda", bf16
    python benchmarks/fingerprint.py --compare old.json new.json    # equal / different per tensor

Run it once per build (the other build through PYTHONPATH, from outside this checkout) and compare the
files; --compare exits with status 1 if any tensor differs or is missing. Only the public constructor of
MoKMoELayer is used, so the script runs against older trees too. Every configuration is seeded by its
index; parameters (in sorted name order), float buffers, x and dy come from a generator on the layer's
device, so the layer's own init code does not enter the fingerprint. --repeat N runs each configuration
N times and reports any run whose bits differ from the first (run-to-run determinism).
--device cpu --backend reference --scale tiny shrinks the shapes so that the list runs on a CPU.
"""
import argparse
import hashlib
import json
import sys

import torch

# name -> (T, layer kwargs); H hidden, I intermediate, E experts, k top_k
CONFIGS = {
    "qwen3": (4096, dict(hidden_size=2048, intermediate_size=768, num_experts=128, top_k=8)),
    "mixtral": (2048, dict(hidden_size=4096, intermediate_size=14336, num_experts=8, top_k=2)),
    "deepseek-v3": (2048, dict(hidden_size=7168, intermediate_size=2048, num_experts=256, top_k=8,
                               score_func="sigmoid", n_group=8, topk_group=4, use_expert_bias=True,
                               routed_scaling_factor=2.5)),
    "gpt-oss": (1024, dict(hidden_size=2880, intermediate_size=2880, num_experts=32, top_k=4,
                           activation="swiglu_oai", expert_proj_bias=True, swiglu_limit=7.0)),
    "h4608": (1024, dict(hidden_size=4608, intermediate_size=1536, num_experts=16, top_k=4)),
    "i256": (1000, dict(hidden_size=1024, intermediate_size=256, num_experts=32, top_k=4)),
    "i384": (777, dict(hidden_size=2048, intermediate_size=384, num_experts=64, top_k=6)),
    "t1": (1, dict(hidden_size=2048, intermediate_size=768, num_experts=128, top_k=8)),
    "t129": (129, dict(hidden_size=2048, intermediate_size=768, num_experts=64, top_k=8)),
    "empty-experts": (8, dict(hidden_size=1024, intermediate_size=512, num_experts=64, top_k=2)),
    "shared-expert": (1024, dict(hidden_size=2048, intermediate_size=768, num_experts=64, top_k=4,
                                 shared_intermediate_size=1536)),
    "top2-unnormalised": (2048, dict(hidden_size=1024, intermediate_size=1024, num_experts=16, top_k=2,
                                     norm_topk_prob=False)),
    "top16": (512, dict(hidden_size=1024, intermediate_size=512, num_experts=64, top_k=16)),
    "top20": (300, dict(hidden_size=1024, intermediate_size=512, num_experts=128, top_k=20)),
}
STD = 0.02


def tiny(tokens, kw):
    """The same configuration at a size a CPU runs in well under a second."""
    kw = dict(kw, hidden_size=32, intermediate_size=16, num_experts=max(kw["top_k"], min(kw["num_experts"], 32)))
    if kw.get("shared_intermediate_size"):
        kw["shared_intermediate_size"] = 16
    return min(tokens, 8), kw


def digest(t):
    """sha256 of dtype, shape and raw bytes."""
    h = hashlib.sha256(f"{t.dtype} {tuple(t.shape)}".encode())
    h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def fingerprint(index, tokens, kw, device, dtype, backend):
    """{tensor name: sha256} of one seeded forward+backward."""
    from mok_nn import MoKMoELayer

    torch.manual_seed(index)
    layer = MoKMoELayer(**kw, backend=backend, device=device, dtype=dtype)
    g = torch.Generator(device=device).manual_seed(index)
    with torch.no_grad():
        for _, p in sorted(layer.named_parameters()):
            p.normal_(0.0, STD, generator=g)
        for _, b in sorted(layer.named_buffers()):
            if b.is_floating_point():
                b.normal_(0.0, STD, generator=g)
    shape = (tokens, kw["hidden_size"])
    x = torch.randn(shape, generator=g, device=device, dtype=dtype).requires_grad_()
    dy = torch.randn(shape, generator=g, device=device, dtype=dtype)
    y = layer(x)
    y.backward(dy)
    out = {"y": digest(y), "x.grad": digest(x.grad)}
    for name, p in sorted(layer.named_parameters()):
        out[f"{name}.grad"] = "none" if p.grad is None else digest(p.grad)
    return out


def compare(path_a, path_b):
    """Prints equal / different / missing per tensor; 0 if every tensor is equal, else 1."""
    with open(path_a) as f:
        a = json.load(f)
    with open(path_b) as f:
        b = json.load(f)
    bad = 0
    for cfg in sorted(set(a) | set(b), key=lambda c: (c not in a, c)):
        ta, tb = a.get(cfg, {}), b.get(cfg, {})
        for name in sorted(set(ta) | set(tb)):
            if name not in ta or name not in tb:
                verdict = f"missing in {path_a if name not in ta else path_b}"
            else:
                verdict = "equal" if ta[name] == tb[name] else "different"
            bad += verdict != "equal"
            print(f"{cfg:<20} {name:<40} {verdict}")
    print(f"{bad} tensor(s) differ or are missing" if bad else "all equal")
    return 1 if bad else 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compare", nargs=2, metavar=("A.json", "B.json"), help="compare two fingerprint files")
    ap.add_argument("--out", help="JSON file {config: {tensor: sha256}}")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset of: " + ", ".join(CONFIGS))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--backend", default="cuda", choices=("cuda", "reference", "auto"))
    ap.add_argument("--scale", default="full", choices=("full", "tiny"))
    ap.add_argument("--repeat", type=int, default=1, help="runs per configuration (1: no determinism check)")
    a = ap.parse_args(argv)
    if a.compare:
        return compare(*a.compare)
    names = [c for c in a.configs.split(",") if c]
    unknown = [c for c in names if c not in CONFIGS]
    if unknown:
        ap.error(f"unknown configs {unknown}")
    import mok_nn

    print(f"mok_nn from {mok_nn.__file__}, torch {torch.__version__}, device {a.device}, backend {a.backend}",
          flush=True)
    result, unstable = {}, []
    for name in names:
        index = list(CONFIGS).index(name)
        tokens, kw = CONFIGS[name] if a.scale == "full" else tiny(*CONFIGS[name])
        runs = [fingerprint(index, tokens, kw, a.device, torch.bfloat16, a.backend) for _ in range(a.repeat)]
        result[name] = runs[0]
        if any(r != runs[0] for r in runs[1:]):
            unstable.append(name)
        print(f"{name:<20} T={tokens:<5} {len(runs[0])} tensors  y {runs[0]['y'][:16]}"
              + ("  DIFFERS BETWEEN RUNS" if name in unstable else ""), flush=True)
        if a.device.startswith("cuda"):
            torch.cuda.empty_cache()
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1, sort_keys=True)
        print(f"wrote {a.out}")
    return 1 if unstable else 0


if __name__ == "__main__":
    sys.exit(main())
