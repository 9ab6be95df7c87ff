"""Diagnostic (not a test): this GPU's memory rates for plain writes (memset, fill), copies and reads, 1 GiB each."""
import torch, statistics
def t(fn, reps=20):
    for _ in range(3): fn()
    ev=[(torch.cuda.Event(enable_timing=True),torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for s,e in ev:
        s.record(); fn(); e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s,e in ev)
n = 1 << 30
a = torch.empty(n, dtype=torch.uint8, device="cuda"); b = torch.empty_like(a)
af = a.view(torch.float32)
print(f"zero_ (memset) 1 GiB: {n/ t(lambda: a.zero_())/1e9:.2f} TB/s")
print(f"fill_ 1.0 fp32 1 GiB: {n/ t(lambda: af.fill_(1.0))/1e9:.2f} TB/s")
print(f"copy_ 1 GiB (r+w): {2*n/ t(lambda: b.copy_(a))/1e9:.2f} TB/s")
print(f"sum fp32 1 GiB (read): {n/ t(lambda: af.sum())/1e9:.2f} TB/s")
# The rates above move constant data, which the GPU may store compressed (Hopper compresses uniform data in
# memory): random bytes show what incompressible rows (activations) can get.
a.copy_(torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda"))
print(f"copy_ 1 GiB of random bytes (r+w): {2*n/ t(lambda: b.copy_(a))/1e9:.2f} TB/s")
print(f"sum of random bytes as fp32 1 GiB (read): {n/ t(lambda: a.view(torch.float32).sum())/1e9:.2f} TB/s")
