"""Diagnostic (not a test): the cooperative grouped GEMMs with static vs dynamic tiles, with and without
skipping the MMA of all-padding warp groups ("tail skip"), call by call.

    OUT=/tmp python tests/gpu/diag_tail_skip.py [--shapes deepseek-v3,qwen3-30b-a3b] [--reps 20]

Tail skip (a consumer warp group whose 64 rows are all padding issues no wgmma; the kernels' branch
is taken when seg_rows are the routed rows instead of the padded sizes) was slower with the static
persistent schedule: CTAs drift apart, L2 hit rate fell from 49% to 27% (docs/kernels.md). The _dyn
GEMMs (VarlenMGroupedGemmDyn) claim tiles by atomic add, so a CTA whose tile ran short takes the next
one. For the layer's GEMMs at 8192 tokens that have a _dyn twin (gate/up unfused, down, dgrad of
gate/up, dgrad of down unfused: whichever the cooperative kernel runs at the shape) this times, call by
call (CUDA events, median; the _dyn calls include zeroing their counter, as the layer does):

    static       the cooperative kernel, padded seg_rows   (MOK_GEMM_TILES=static)
    static_skip  the same, routed seg_rows
    dyn          its _dyn twin, padded seg_rows
    dyn_skip     its _dyn twin, routed seg_rows            (MOK_GEMM_TILES=dynamic)

and checks the used rows of all four bitwise equal (all-padding halves store exact zeros either way).
The tile order is cuda_backend.gemm_group_m's (MOK_GEMM_RASTER).
--energy S: also each mode's energy per call, mean power and SM clock over about S seconds of back-to-back
calls (the GPU's NVML counter, diag_energy.run_for), twice in the order of the modes: where the GPU runs at its
power limit a variant's time follows its energy per call (docs/kernels.md).
Prints a table, writes tail_skip.json to $OUT. Exit status 1 if bits differ.
"""

import argparse
import json
import os

import torch

from mok_nn import bench
from mok_nn import cuda_backend as cb

from layer_runs import median_ms_queued


def layer_gemms(p, sched):
    """(label, A rows, W, transpose_w, out dtype) of the layer's GEMMs, A random in schedule order."""
    T, H = p["x"].shape
    inter = p["down_proj"].shape[2]

    def rows(width):
        return cb.gather_rows(torch.randn(T, width, device="cuda").to(torch.bfloat16), sched)

    return (
        ("gate_up", rows(H), p["gate_up_proj"], False, torch.bfloat16),
        ("down", rows(inter), p["down_proj"], False, torch.bfloat16),
        ("dgrad_gate_up", rows(2 * inter), p["gate_up_proj"], True, torch.bfloat16),
        ("dgrad_down", rows(H), p["down_proj"], True, torch.float32),
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="deepseek-v3,qwen3-30b-a3b,mixtral-8x7b")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--energy", type=float, default=0.0, help="seconds of calls per energy reading (0: none)")
    ap.add_argument("--gemms", default="", help="comma-separated subset of gate_up,down,dgrad_gate_up,dgrad_down")
    args = ap.parse_args()
    nvml = None
    if args.energy > 0:
        from diag_energy import Nvml, run_for

        nvml = Nvml(torch.cuda.current_device())
    lib = cb._lib()
    stream = torch.cuda.current_stream().cuda_stream
    records, ok = [], True
    for shape in args.shapes.split(","):
        p = bench.make_problem(shape, 8192, "cuda")
        E = p["gate_up_proj"].shape[0]
        sched = cb.make_schedule(p["ids"], E)
        used = int(sched.seg_end[-1])
        for gname, a, W, transpose_w, out_dtype in layer_gemms(p, sched):
            if args.gemms and gname not in args.gemms.split(","):
                continue
            name = cb.gemm_kernel(transpose_w, out_dtype, k=a.shape[1], pingpong=False)
            if name + "_dyn" not in cb.SPECS_BY_NAME:
                print(f"{shape:<14} {gname:<14} {name:<16} (no _dyn twin: skipped)")
                continue
            n = W.shape[2] if transpose_w else W.shape[1]
            b = W.permute(2, 1, 0) if transpose_w else W.permute(1, 2, 0)
            group_m = cb.gemm_group_m(n)
            rows = {"padded": sched.gemm_seg_rows(), "routed": sched.seg_rows}
            outs = {}

            def run(mode, out):
                seg_rows = rows["routed" if mode.endswith("skip") else "padded"]
                if mode.startswith("dyn"):
                    ctr = torch.zeros(1, dtype=torch.int32, device="cuda")
                    lib.launch(name + "_dyn", a.unsqueeze(-1), b, out.unsqueeze(-1), sched.tile_expert,
                               sched.seg_end, seg_rows, group_m, ctr, stream=stream)
                else:
                    lib.launch(name, a.unsqueeze(-1), b, out.unsqueeze(-1), sched.tile_expert, sched.seg_end,
                               seg_rows, group_m, stream=stream)

            times = {}
            for mode in ("static", "static_skip", "dyn", "dyn_skip"):
                out = torch.full((sched.capacity, n), float("nan"), device="cuda", dtype=out_dtype)
                run(mode, out)
                torch.cuda.synchronize()
                outs[mode] = out[:used].clone()
                times[mode] = median_ms_queued(lambda m=mode, o=out: run(m, o), args.reps)
            energy = {}
            if nvml is not None:  # each mode twice, in turn: (ms, J, W, MHz) per call
                for rnd in range(2):
                    for mode in times:
                        out = torch.empty(sched.capacity, n, device="cuda", dtype=out_dtype)
                        energy.setdefault(mode, []).append(run_for(lambda m=mode, o=out: run(m, o), args.energy, nvml))
            bits = {torch.bfloat16: torch.int16, torch.float32: torch.int32}[out_dtype]
            base = outs["static"].view(bits)
            for mode, t in times.items():
                same = bool(torch.equal(outs[mode].view(bits), base))
                ok &= same
                joules = "".join(f" | {e[0]:6.3f} ms {e[1]:5.2f} J {e[2]:4.0f} W {e[3]:5.0f} MHz" for e in energy.get(mode, []))
                print(f"{shape:<14} {gname:<14} {name:<16} {mode:<12} {t:8.3f} ms  {times['static'] / t:5.2f}x  "
                      f"bits{'==static' if same else ' DIFFER'}{joules}", flush=True)
                records.append(dict(shape=shape, gemm=gname, kernel=name, mode=mode, ms=t, bitwise_eq_static=same,
                                    energy_ms_j_w_mhz=energy.get(mode, []), commit=os.environ.get("MOK_COMMIT", "unknown")))
            del outs
        del p
        torch.cuda.empty_cache()
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "tail_skip.json"), "w") as f:
        json.dump(records, f, indent=1)
    print("all bits equal" if ok else "BITS DIFFER")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
