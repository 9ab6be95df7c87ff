"""Diagnostic (not a test): run mok_gemm_bk on small dense problems and save inputs/outputs."""
import os, torch
from mok_nn.kernels import loader
lib = loader.load("sm_90a")
res = {}
for (M, N, K, E) in [(128, 256, 64, 1), (256, 256, 128, 1), (256, 512, 128, 2)]:
    a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    W = torch.randn(E, N, K, device="cuda", dtype=torch.bfloat16)
    te = (torch.arange(M // 128, device="cuda", dtype=torch.int32) % E)
    out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
    seg = torch.full((E,), M, device="cuda", dtype=torch.int32)  # seg_end = seg_rows = M: every row real
    lib.launch("mok_gemm_bk", a.unsqueeze(-1), W.permute(1, 2, 0), out.unsqueeze(-1), te, seg, seg, 1, stream=torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    ref = torch.stack([a[i].float() @ W[te[i // 128]].float().T for i in range(M)])
    err = ((out.float() - ref).norm() / ref.norm()).item()
    print(M, N, K, E, "rel err", err, "nan", torch.isnan(out).sum().item(), flush=True)
    res[(M, N, K, E)] = dict(a=a.cpu(), W=W.cpu(), te=te.cpu(), out=out.cpu())
torch.save(res, os.path.join(os.environ.get("OUT", "."), "diag.pt"))
