"""The one-GPU path's host wiring (cuda_backend), on the CPU with torch stand-ins for the kernels.

The stand-in library checks every launch against its registry spec (argument count, dtypes, ranks,
fixed extents) and computes the varlen-M grouped GEMMs in fp32 tile by tile. What is tested is the
plumbing: which kernel runs for which shape (the measured rules), that every launch matches its
kernel's arguments, and that the results are the experts' function; the kernels themselves are checked
on the GPU (tests/gpu/test_cuda_kernels.py).
"""

import dataclasses

import pytest
import torch

from mok_nn import cuda_backend as cb
from mok_nn import reference
from mok_nn.kernels import registry

from test_cuda_ep_simulated import SpecChecked

_DTYPES = {"bf16": torch.bfloat16, "f32": torch.float32, "i32": torch.int32, "i64": torch.int64}


class _FakeLib:
    def __init__(self):
        self.calls = []

    def launch(self, name, *args, stream):
        spec = registry.SPECS_BY_NAME[name]
        assert len(args) == len(spec.args), name
        for a, t in zip(spec.args, args):
            if isinstance(a, registry.ScalarArg):
                continue
            assert t.dtype == _DTYPES[a.dtype], (name, a.name, t.dtype)
            assert t.dim() == len(a.shape), (name, a.name, t.shape)
            for s, n in zip(a.shape, t.shape):
                assert s == registry.DYN or s == n, (name, a.name, t.shape)
        self.calls.append(name)
        if spec.factory == "VarlenMGroupedGemm":
            a, b, c, te, seg_end, seg_rows, _ = args
            _gemm(a[:, :, 0], b, c, te)
        elif spec.factory == "VarlenMGroupedGemmDyn":  # dynamic tiles: the same tiles, claimed from a zeroed counter
            a, b, c, te, seg_end, seg_rows, _, counter = args
            assert int(counter[0]) == 0, f"{name}: tile counter not zeroed before the launch"
            _gemm(a[:, :, 0], b, c, te)
        elif spec.factory == "MxQuant":
            src, dst, te, seg_end, seg_rows, row_src, mode, grid = args
            assert mode in (0, 1, 2, 3, 4) and grid >= 1
            if mode == 3:  # mode 2 into dst, mode 0 into src itself
                dst.copy_(_mx_quant(src, 2, seg_end, seg_rows))
                src.copy_(_mx_quant(src, 0, seg_end, seg_rows))
            elif mode == 4:  # mode 2 of src's rows row_src[r] (src's row count: a zero row)
                assert row_src.shape[0] == dst.shape[0] and int(row_src.max()) <= src.shape[0]
                rows = torch.cat([src, src.new_zeros(1, src.shape[1])]).index_select(0, row_src)
                dst.copy_(_mx_quant(rows, 2, seg_end, seg_rows))
            else:
                dst.copy_(_mx_quant(src, mode, seg_end, seg_rows))
        else:
            raise AssertionError(f"stand-in has no {name}")


def _mx_quant(src, mode, seg_end, seg_rows):
    """mok_mx_quant's contract, from mxfp8.fake_quantize (the slow quantiser): along the columns (mode 0), the
    rows (1), or the rows with only each expert's routed rows (the first seg_rows of its segment) kept (2)."""
    from mok_nn.mxfp8 import fake_quantize

    if mode == 0:
        return fake_quantize(src, -1)
    if mode == 2:
        kept = torch.zeros_like(src)
        start = 0
        for end, n in zip(seg_end.tolist(), seg_rows.tolist()):
            kept[start:start + n] = src[start:start + n]
            start = end
        src = kept
    return fake_quantize(src, 0)


def _gemm(a, b, c, tile_expert):
    """c[m] = a[m] @ b[:, :, e(m)]^T per 128-row tile, fp32 sums, rounded once."""
    for t, e in enumerate(tile_expert.tolist()):
        if e < 0:
            continue
        r = slice(t * registry.TILE_M, (t + 1) * registry.TILE_M)
        c[r, :, 0] = (a[r].float() @ b[:, :, e].float().T).to(c.dtype)


def random_problem(T, H, I, E, K, bias, seed):
    """(x, ids, w, dy, W13, W2, b13, b2): fresh random inputs, bf16 rows and weights, fp32 top-k weights."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g)
    dy = torch.randn(T, H, generator=g).bfloat16()
    W13 = (torch.randn(E, 2 * I, H, generator=g) / H**0.5).bfloat16()
    W2 = (torch.randn(E, H, I, generator=g) / I**0.5).bfloat16()
    b13 = (torch.randn(E, 2 * I, generator=g) * 0.1).bfloat16() if bias else None
    b2 = (torch.randn(E, H, generator=g) * 0.1).bfloat16() if bias else None
    return x, ids, w, dy, W13, W2, b13, b2


@pytest.fixture
def fake_lib(monkeypatch):
    lib = _FakeLib()
    monkeypatch.setattr(cb, "_lib", lambda: SpecChecked(lib))
    monkeypatch.setattr(cb, "_stream", lambda: 0)
    monkeypatch.setattr(cb, "check_supported", lambda *a: None)
    monkeypatch.setattr(cb, "combine", cb.combine_torch)
    monkeypatch.setenv("MOK_ACT", "torch")  # no fused activation kernels: the plain GEMMs everywhere
    monkeypatch.delenv("MOK_GEMM", raising=False)
    monkeypatch.setattr(cb, "weight_grad", _torch_weight_grad)
    return lib


def _torch_weight_grad(a_rows, b_rows, sched, counts, into=None, out=None, cols=None):
    """The weight gradients by torch._grouped_mm (the kernels' contract; MOK_GEMM=torch's formula): returned,
    added into `into`, or written into `out`."""
    grad = torch._grouped_mm(a_rows.t(), b_rows, offs=sched.seg_end)
    if into is not None:
        return into.add_(grad.to(into.dtype))
    return grad if out is None else out.copy_(grad)


@pytest.mark.parametrize("T,H,I,bias,activation,limit", [
    (37, 32, 16, False, "swiglu", None),  # every K <= 1024: the clustered ping-pong kernels
    (1, 32, 16, True, "swiglu_oai", 7.0),
    (20, 1040, 520, False, "swiglu", None),  # K = H, 2I > 1024: the whole-tile kernels with dynamic tiles
])
def test_default_path_launches_and_function(fake_lib, T, H, I, bias, activation, limit):
    x, ids, w, dy, W13, W2, b13, b2 = random_problem(T, H, I, 4, 2, bias, seed=T + H)
    args = (W13, W2, b13, b2, activation, limit)
    y, saved = cb.experts_forward(x, ids, w, *args)
    dx, dtk, grads = cb.experts_backward(dy, saved, x, ids, w, *args)
    gemms = [c for c in fake_lib.calls if c.startswith("mok_gemm")]
    # forward gate/up (K = H), down (K = I); backward dgrad of down (fp32), dgrad of gate/up (K = 2I)
    assert gemms == [cb.gemm_kernel(False, k=H), cb.gemm_kernel(False, k=I), "mok_gemm_bn_f32_dyn",
                     cb.gemm_kernel(True, k=2 * I)], gemms
    # the forward keeps the schedule and gate_up only (no x rows: the backward gathers them again)
    assert [f.name for f in dataclasses.fields(saved)] == ["sched", "gate_up"]
    # the experts' function (fp32 stand-ins, bf16 roundings: close to the reference)
    y_ref, saved_r = reference.experts_forward(x, ids, w, *args)
    dx_r, dtk_r, grads_r = reference.experts_backward(dy, saved_r, x, ids, w, *args)
    for got, want in ((y, y_ref), (dx, dx_r), (dtk, dtk_r), (grads.gate_up_proj, grads_r.gate_up_proj),
                      (grads.down_proj, grads_r.down_proj)):
        assert (got.float() - want.float()).norm() <= 2e-2 * want.float().norm()


def test_backward_frees_each_row_buffer_before_the_next_one(fake_lib, monkeypatch):
    """Peak memory of the backward: the d y rows and w h are gone when the d x rows are computed (the down
    weight's gradient ran first), and the d x rows are gone when the gate/up weight's gradient runs; the result
    is the same as before the spies."""
    import weakref

    x, ids, w, dy, W13, W2, b13, b2 = random_problem(37, 32, 16, 4, 2, False, seed=7)
    args = (W13, W2, b13, b2, "swiglu", None)
    _, saved = cb.experts_forward(x, ids, w, *args)
    want = cb.experts_backward(dy, saved, x, ids, w, *args)
    refs, events = {}, []
    gather, act_b, gemm, wgrad = cb.gather_rows, cb.act_backward, cb.grouped_gemm, cb.weight_grad

    def alive(name):
        return name in refs and refs[name]() is not None

    def spy_gather(t, sched, skip_tail=False, mx=False):
        out = gather(t, sched, skip_tail, mx)
        refs["dy_rows"] = weakref.ref(out)
        return out

    def spy_act_b(*a, **kw):
        dgu, wh, dw = act_b(*a, **kw)
        refs["wh"] = weakref.ref(wh)
        return dgu, wh, dw

    def spy_gemm(a, wt, sched, transpose_w, out_dtype=torch.bfloat16):
        if transpose_w and out_dtype == torch.bfloat16:  # the dgrad of gate/up: the d x rows
            events.append(("dx_rows", alive("dy_rows"), alive("wh")))
            out = gemm(a, wt, sched, transpose_w, out_dtype)
            refs["dx_rows"] = weakref.ref(out)
            return out
        return gemm(a, wt, sched, transpose_w, out_dtype)

    def spy_wgrad(*a, **kw):
        events.append(("wgrad", alive("dx_rows")))
        return wgrad(*a, **kw)

    for name, f in (("gather_rows", spy_gather), ("act_backward", spy_act_b), ("grouped_gemm", spy_gemm),
                    ("weight_grad", spy_wgrad)):
        monkeypatch.setattr(cb, name, f)
    got = cb.experts_backward(dy, saved, x, ids, w, *args)
    assert events == [("wgrad", False), ("dx_rows", False, False), ("wgrad", False)], events
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(got[2].gate_up_proj, want[2].gate_up_proj) and torch.equal(got[2].down_proj,
                                                                                  want[2].down_proj)


def _spied_gathers(monkeypatch) -> list:
    """Weak references to the results of gather_rows from now on, in call order."""
    import weakref

    refs, gather = [], cb.gather_rows

    def spy(t, sched, skip_tail=False, mx=False):
        out = gather(t, sched, skip_tail, mx)
        refs.append(weakref.ref(out))
        return out

    monkeypatch.setattr(cb, "gather_rows", spy)
    return refs


def test_forward_frees_the_x_rows_before_the_down_gemm(fake_lib, monkeypatch):
    """Peak memory of the forward: the x rows (the gate/up GEMM's A) are gone when the down GEMM's output is
    made (mlp_rows_forward holds the only reference and drops it after the gate/up GEMM); the same y."""
    x, ids, w, dy, W13, W2, b13, b2 = random_problem(37, 32, 16, 4, 2, False, seed=8)
    args = (W13, W2, b13, b2, "swiglu", None)
    want, _ = cb.experts_forward(x, ids, w, *args)
    events, gemm = [], cb.grouped_gemm
    refs = _spied_gathers(monkeypatch)

    def spy_gemm(a, wt, sched, transpose_w, out_dtype=torch.bfloat16):
        events.append((wt.shape == W2.shape, refs[0]() is not None))
        return gemm(a, wt, sched, transpose_w, out_dtype)

    monkeypatch.setattr(cb, "grouped_gemm", spy_gemm)
    got, _ = cb.experts_forward(x, ids, w, *args)
    assert len(refs) == 1 and events == [(False, True), (True, False)], events  # gate/up with x rows, down without
    assert torch.equal(got, want)


@pytest.mark.parametrize("frozen", [False, True])
def test_dgrad_frees_the_dy_rows_it_alone_needs(fake_lib, monkeypatch, frozen):
    """The dgrad of down as two kernels: with frozen experts (no bias) the d y rows feed that GEMM alone and are gone
    when the activation backward makes its outputs; with trained ones d down_proj still needs them. The same d x
    and d topk-weights either way."""
    x, ids, w, dy, W13, W2, b13, b2 = random_problem(37, 32, 16, 4, 2, False, seed=9)
    args = (W13, W2, b13, b2, "swiglu", None)
    needs = (False, False, False, False) if frozen else None
    _, saved = cb.experts_forward(x, ids, w, *args)
    want = cb.experts_backward(dy, saved, x, ids, w, *args, needs=needs)
    events, act_b = [], cb.act_backward
    refs = _spied_gathers(monkeypatch)

    def spy_act_b(*a, **kw):
        events.append(refs[0]() is not None)
        return act_b(*a, **kw)

    monkeypatch.setattr(cb, "act_backward", spy_act_b)
    got = cb.experts_backward(dy, saved, x, ids, w, *args, needs=needs)
    assert events == [not frozen], events
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_x_column_blocks():
    """d gate_up_proj's column blocks of x: as few as keep one block's rows within X_BLOCK_BYTES, at most
    X_MAX_COLUMN_BLOCKS, of whole 256-column tiles (fewer where H is small), the last one shorter where H is not a
    multiple of the width. The benchmark shapes at 8192 tokens (schedule_capacity rows): 2, 1 and 4 blocks."""
    rows = {h: cb.schedule_capacity(8192, k, e) for h, k, e in ((2048, 8, 128), (4096, 2, 8), (7168, 8, 256))}
    assert cb.x_column_blocks(2048, rows[2048]) == [(0, 1024), (1024, 2048)]  # qwen3-30b-a3b: 335 MB of rows
    assert cb.x_column_blocks(4096, rows[4096]) == [(0, 4096)]  # mixtral-8x7b: 143 MB
    assert cb.x_column_blocks(7168, rows[7168]) == [(0, 1792), (1792, 3584), (3584, 5376), (5376, 7168)]
    big = cb.X_BLOCK_BYTES  # rows of 1 byte a value: blocks of exactly X_BLOCK_BYTES allowed, one more not
    assert cb.x_column_blocks(2048, 2 * big // 2048, elem_bytes=1) == [(0, 1024), (1024, 2048)]
    assert cb.x_column_blocks(2048, 2 * big // 2048 + 1, elem_bytes=1) == [(0, 768), (768, 1536), (1536, 2048)]
    assert cb.x_column_blocks(1040, 10**6) == [(0, 512), (512, 1024), (1024, 1040)]
    assert cb.x_column_blocks(32, 10**6) == [(0, 32)]
    assert cb.x_column_blocks(1040, 100) == [(0, 1040)]


def _exact_weight_grad(a_rows, b_rows, sched, counts, into=None, out=None, cols=None):
    """_torch_weight_grad with each expert's products summed in float64 (exact for these sizes), so the result
    of a column block does not depend on how a BLAS blocks its sums."""
    grad = torch.zeros(sched.num_experts, a_rows.shape[1], b_rows.shape[1], dtype=torch.float64)
    start = 0
    for e, end in enumerate(sched.seg_end.tolist()):
        grad[e] = a_rows[start:end].double().T @ b_rows[start:end].double()
        start = end
    grad = grad.to(a_rows.dtype)
    if into is not None:
        return into.add_(grad.to(into.dtype))
    return grad if out is None else out.copy_(grad)


@pytest.mark.parametrize("macrobatch", [False, True])
def test_gate_up_weight_grad_in_column_blocks(fake_lib, monkeypatch, macrobatch):
    """d gate_up_proj a column block of x at a time: each block's x rows gathered from x's columns alone and
    gone before the next block's are gathered; bitwise the one-block result (also adding into an earlier
    pass's gradients), which is the experts' function."""
    import weakref

    monkeypatch.setattr(cb, "weight_grad", _exact_weight_grad)
    x, ids, w, dy, W13, W2, b13, b2 = random_problem(20, 1040, 520, 4, 2, False, seed=11)
    args = (W13, W2, b13, b2, "swiglu", None)

    def backward():
        _, saved = cb.experts_forward(x, ids, w, *args)
        into = None
        if macrobatch:  # a first pass's gradients to add into
            into = cb.experts_backward(dy, cb.experts_forward(x, ids, w, *args)[1], x, ids, w, *args)[2]
        return cb.experts_backward(dy, saved, x, ids, w, *args, grads_into=into)[2].gate_up_proj

    gathers, gather = [], cb.gather_rows

    def spy_gather(t, sched, skip_tail=False, mx=False):
        if t._base is x:  # a column block of x: the previous block's rows are gone
            assert all(ref() is None for _, ref in gathers), "x rows of an earlier block still alive"
        out = gather(t, sched, skip_tail, mx)
        if t._base is x:
            gathers.append((t.shape[1], weakref.ref(out)))
        return out

    monkeypatch.setattr(cb, "gather_rows", spy_gather)
    monkeypatch.setattr(cb, "X_BLOCK_BYTES", 1024)  # (small rows: several blocks)
    blocks = backward()
    assert [width for width, _ in gathers] == [512, 512, 16] * (2 if macrobatch else 1)
    monkeypatch.setattr(cb, "x_column_blocks", lambda hidden, rows: [(0, hidden)])
    whole = backward()
    assert torch.equal(blocks, whole)
    _, saved_r = reference.experts_forward(x, ids, w, *args)
    want = reference.experts_backward(dy, saved_r, x, ids, w, *args)[2].gate_up_proj * (2 if macrobatch else 1)
    assert (blocks.float() - want.float()).norm() <= 1e-2 * want.float().norm()


class _WgradLib:
    """VarlenKGroupedGemm's contract on CPU (float64 sums: exact here), storing into the c it is given."""

    def __init__(self):
        self.stores = []

    def launch(self, name, a, b, c, seg_end, seg_rows, group_m, stream):
        spec = registry.SPECS_BY_NAME[name]
        assert spec.factory == "VarlenKGroupedGemm", name
        self.stores.append((name, c.data_ptr()))
        start = 0
        for e, end in enumerate(seg_end.tolist()):
            n = int(seg_rows[e])
            res = (a[:, start:start + n, 0].double() @ b[:, start:start + n, 0].double().T).to(torch.bfloat16)
            if dict(spec.factory_kwargs).get("accumulate"):
                res = (c[:, :, e].float() + res.float()).to(torch.bfloat16)
            c[:, :, e] = res
            start = end


@pytest.mark.parametrize("accumulate", [False, True])
def test_weight_grad_kernel_stores_into_column_blocks(monkeypatch, accumulate):
    """weight_grad(out=) / (into=) on a column block of a gradient launches the kernel on the block's view itself
    (its strides checked against the kernel's spec, as the library checks them), with the kernel the whole
    gradient's columns choose; the blocks give the whole gradient's bits. A block at an unaligned column takes
    the copying path."""
    from test_cuda_ep_simulated import SpecChecked

    lib = _WgradLib()
    monkeypatch.setattr(cb, "_lib", lambda: SpecChecked(lib))
    monkeypatch.setattr(cb, "_stream", lambda: 0)
    monkeypatch.setattr(cb, "_kernel_stores_into", cb.wgrad_output_layout)  # (no CUDA tensors here)
    monkeypatch.delenv("MOK_GEMM", raising=False)
    g = torch.Generator().manual_seed(4)
    E, Na, H = 4, 48, 1040
    ids = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(50)])
    sched = cb.make_schedule_torch(ids, E)
    a = torch.randn(sched.capacity, Na, generator=g).to(torch.bfloat16)
    b = torch.randn(sched.capacity, H, generator=g).to(torch.bfloat16)
    start = torch.randn(E, Na, H, generator=g).to(torch.bfloat16)
    whole = start.clone() if accumulate else torch.empty(E, Na, H, dtype=torch.bfloat16)
    cb.weight_grad(a, b, sched, sched.seg_rows, **({"into": whole} if accumulate else {"out": whole}))
    grad = start.clone() if accumulate else torch.empty(E, Na, H, dtype=torch.bfloat16)
    lib.stores.clear()
    blocks = cb.x_column_blocks(H, 10**6)
    assert len(blocks) == 3
    for c0, c1 in blocks:
        block = grad[:, :, c0:c1]
        got = cb.weight_grad(a, b[:, c0:c1].contiguous(), sched, sched.seg_rows, cols=H,
                             **({"into": block} if accumulate else {"out": block}))
        assert got.data_ptr() == block.data_ptr()
    name = cb.wgrad_kernel(sched, H, accumulate)
    kernel = cb.WGRAD_ACC_KERNELS[name] if accumulate else name
    assert lib.stores == [(kernel, grad[:, :, c0].data_ptr()) for c0, _ in blocks]
    assert torch.equal(grad, whole)
    odd = grad[:, :, 3:11]  # 6 bytes past a 16-byte boundary: not a layout the kernels store into
    assert not cb.wgrad_output_layout(odd)
    lib.stores.clear()
    cb.weight_grad(a, b[:, 3:11].contiguous(), sched, sched.seg_rows, out=odd)
    assert len(lib.stores) == 1 and lib.stores[0][1] != odd.data_ptr()
    assert torch.equal(odd, whole[:, :, 3:11]) or accumulate


def test_consumed_gate_up_takes_d_gate_up(fake_lib):
    """experts_backward(consume_saved=True) (autograd keeps no graph): d gate_up overwrites the saved gate_up
    (no buffer of its own) and every result is the bits of the backward that keeps it."""
    x, ids, w, dy, W13, W2, b13, b2 = random_problem(37, 32, 16, 4, 2, True, seed=9)
    args = (W13, W2, b13, b2, "swiglu", None)
    _, saved = cb.experts_forward(x, ids, w, *args)
    used = int(saved.sched.seg_end[-1])  # (rows past the last segment stay unwritten)
    kept = saved.gate_up.clone()
    want = cb.experts_backward(dy, saved, x, ids, w, *args)
    assert torch.equal(saved.gate_up[:used], kept[:used])
    got = cb.experts_backward(dy, saved, x, ids, w, *args, consume_saved=True)
    assert not torch.equal(saved.gate_up[:used], kept[:used])
    for a, b in zip((got[0], got[1], *dataclasses.astuple(got[2])[2:]), (want[0], want[1],
                                                                          *dataclasses.astuple(want[2])[2:])):
        assert (a is None and b is None) or torch.equal(a, b)


def test_backward_op_on_the_cuda_path(fake_lib, monkeypatch):
    """mok_nn.ops' backward op with backend="cuda" (torch.compile's path): the schedule rebuilt from the ids and
    the forward op's gate_up give the bits of experts_backward on the forward's own saved tensors."""
    from mok_nn import ops

    monkeypatch.setattr(cb, "make_schedule", lambda ids, num_experts, capacity=None, gather_x=None, gather_mx=False:
                        cb.make_schedule_torch(ids, num_experts, capacity))
    x, ids, w, dy, W13, W2, b13, b2 = random_problem(37, 32, 16, 4, 2, True, seed=13)
    args = (W13, W2, b13, b2, "swiglu", None)
    y, gate_up = ops.routed_experts_fwd(x, ids, w, *args, "cuda")
    got = ops.routed_experts_bwd(dy, x, ids, w, gate_up, *args, "cuda")
    y0, saved = cb.experts_forward(x, ids, w, *args)
    dx, dtk, g = cb.experts_backward(dy, saved, x, ids, w, *args)
    assert torch.equal(y, y0)
    for a, b in zip(got, (dx, dtk, g.gate_up_proj, g.down_proj, g.gate_up_bias, g.down_bias)):
        assert torch.equal(a, b)
