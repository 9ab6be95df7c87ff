"""Kernel A/B: the plain MX GEMM (cooperative, SS) against the swapped register-A form and the bf16 kernel on W_q."""
import json, os
import torch
from mok_nn import cuda_backend as cb, cuda_mx
from mok_nn.mxfp8 import quantize

def run(T, k, E, N, K, reps=30, rounds=3):
    g = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.topk(torch.randn(T, E, device="cuda", generator=g), k, dim=1).indices
    sched = cb.make_schedule(ids, E)
    a = torch.randn(sched.capacity, K, device="cuda", generator=g).to(torch.bfloat16)
    q = quantize((torch.randn(E, N, K, device="cuda", generator=g) / K**0.5).to(torch.bfloat16), axis=-1)
    w = cuda_mx.MxWeight(q.data, q.scale)
    wq = w.dequantized()
    bf16 = cb.gemm_kernel(False, k=K)
    forms = {"mok_gemm_bk_mx": w.kernel_operands(), "mok_gemm_bk_mx_swap": w.kernel_operands(), bf16: wq.permute(1, 2, 0)}
    outs = {n: torch.full((a.shape[0], N), float("nan"), dtype=torch.bfloat16, device="cuda") for n in forms}
    res = {n: [] for n in forms}
    for r in range(rounds):
        for n, b in forms.items():
            cb.launch_gemm(n, a, b, outs[n], sched)
            torch.cuda.synchronize()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(reps):
                cb.launch_gemm(n, a, b, outs[n], sched)
            e.record(); torch.cuda.synchronize()
            res[n].append(round(s.elapsed_time(e) / reps, 4))
    rows = sched.pos.reshape(-1)
    ref = outs[bf16][rows]
    n0 = int(sched.seg_rows[0])
    exact = (a[:n0].double() @ wq[0].double().t())
    check = {}
    for n in forms:
        o = outs[n][rows]
        check[n] = {"bitwise_vs_bf16": bool(torch.equal(o.view(torch.int16), ref.view(torch.int16))),
                    "differing": int((o.view(torch.int16) != ref.view(torch.int16)).sum()),
                    "nan": int(o.isnan().sum()),
                    "rel_err_fp64_expert0": float((outs[n][:n0].double() - exact).norm() / exact.norm())}
    again = torch.empty_like(outs["mok_gemm_bk_mx_swap"])
    cb.launch_gemm("mok_gemm_bk_mx_swap", a, forms["mok_gemm_bk_mx_swap"], again, sched)
    check["swap_run_to_run_bitwise"] = bool(torch.equal(again[rows].view(torch.int16), outs["mok_gemm_bk_mx_swap"][rows].view(torch.int16)))
    return {"T": T, "k": k, "E": E, "N": N, "K": K, "ms": res, "check": check}

out = []
for shape in [(300, 2, 8, 256, 256), (8192, 8, 128, 2048, 768), (8192, 8, 64, 1024, 1024), (8192, 8, 128, 1536, 2048), (8192, 8, 256, 7168, 2048)]:
    try:
        r = run(*shape)
    except Exception as err:
        r = {"shape": shape, "error": f"{type(err).__name__}: {err}"}
    print(json.dumps(r), flush=True)
    out.append(r)
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "swap_kernels.json"), "w"), indent=1)
