"""Diagnosis of mok_gemm_bk_mx_swap on one tile: one-hot x rows, so Y[t, f] = W_q[f, t]; dumps Y and W_q."""
import os, torch
from mok_nn import cuda_backend as cb, cuda_mx
from mok_nn.mxfp8 import quantize
out = os.environ.get("OUT", ".")
torch.manual_seed(0)
T, E, N, K = 128, 1, 128, 128
ids = torch.zeros(T, 1, dtype=torch.int64, device="cuda")
sched = cb.make_schedule(ids, E)
a = torch.zeros(sched.capacity, K, device="cuda", dtype=torch.bfloat16)
a[torch.arange(T), torch.arange(T)] = 1.0
res = {}
for scales in ("uniform", "random"):
    w = torch.randn(E, N, K, device="cuda")
    if scales == "random":
        w = w * 2.0 ** torch.randint(-4, 5, (E, N, K // 32, 1), device="cuda").float().repeat_interleave(32, -1).view(E, N, K)
    q = quantize(w.to(torch.bfloat16), axis=-1)
    mw = cuda_mx.MxWeight(q.data, q.scale)
    wq = mw.dequantized()
    for name in ("mok_gemm_bk_mx", "mok_gemm_bk_mx_swap"):
        ys = []
        for rep in range(3):
            y = torch.full((a.shape[0], N), float("nan"), device="cuda", dtype=torch.bfloat16)
            cb.launch_gemm(name, a, mw.kernel_operands(), y, sched)
            torch.cuda.synchronize()
            ys.append(y[:T].float().cpu())
        res[(scales, name)] = ys
        same = all(torch.equal(ys[0], v) for v in ys[1:])
        err = (ys[0] - wq[0].float().cpu().t()).abs()
        print(scales, name, "run-to-run", same, "max err", float(err.max()), "wrong", int((err > 0).sum()),
              "rows(token) wrong", int((err > 0).any(1).sum()), "cols(feature) wrong", int((err > 0).any(0).sum()))
    res[(scales, "wq")] = wq[0].float().cpu()
torch.save(res, os.path.join(out, "swapdiag.pt"))
