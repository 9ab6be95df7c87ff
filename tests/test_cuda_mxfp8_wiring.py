"""precision="mxfp8" on the one-GPU path (cuda_backend), on the CPU with test_cuda_wiring's stand-in kernel
library: each expert GEMM must be launched with its operands' MXFP8 values along its reduction dimension
(docs/mxfp8.md), checked operand by operand against mxfp8.fake_quantize (the slow, independent quantiser),
and the whole function against the float64 model of the definition. The kernels themselves are the bf16 ones
(tests/gpu)."""

import pytest
import torch

from mok_nn import cuda_backend as cb
from mok_nn import cuda_mx
from mok_nn.mxfp8 import fake_quantize, fake_quantize_padded

from test_cuda_wiring import fake_lib, random_problem  # noqa: F401

T, H, I, E, K = 53, 64, 32, 4, 2


def _spread(t: torch.Tensor, seed: int) -> torch.Tensor:
    """t with per-element magnitudes spread over 2**-8..2**8, so that MX blocks (not just the 3-bit rounding)
    show in the values: a block axis or row grouping taken wrongly changes them."""
    g = torch.Generator().manual_seed(seed)
    return (t.float() * torch.exp2(torch.rand(t.shape, generator=g) * 16 - 8)).to(t.dtype)


def _problem(seed=0, bias=False):
    x, ids, w, dy, W13, W2, b13, b2 = random_problem(T, H, I, E, K, bias, seed)
    x, dy, W13, W2 = (_spread(t, seed + i) for i, t in enumerate((x, dy, W13, W2)))
    return x, ids, w, dy, W13, W2, b13, b2


@pytest.fixture(params=["kernel", "torch"])
def quantiser(request, fake_lib, monkeypatch):
    """The MXFP8 values by mok_mx_quant (its CPU stand-in: mxfp8.fake_quantize) or by torch ops
    (fake_quantize_fast, what runs off CUDA and under MOK_ACT=torch)."""
    monkeypatch.setattr(cb, "_mx_kernel_runs", lambda t: request.param == "kernel")
    monkeypatch.setattr(cb, "num_sms", lambda device: 132)
    monkeypatch.setattr(cb, "_cached_zero_tile", lambda device: torch.zeros(1, dtype=torch.int32))
    monkeypatch.setattr(cuda_mx, "_VERDICTS", {})  # every first-use check runs in each test
    return request.param


@pytest.fixture
def spied(quantiser, fake_lib, monkeypatch):
    """Records every GEMM launch's A rows and B operand, the quantisation launches' modes, the activations'
    outputs and the weight-gradient operands."""
    rec = {"gemm": [], "wgrad": [], "act": [], "dact": [], "mx": []}
    launch = fake_lib.launch

    def recording(name, *args, stream):
        if name.startswith("mok_gemm"):
            rec["gemm"].append((name, args[0][:, :, 0].clone(), args[1].clone()))
        if name == "mok_mx_quant":
            rec["mx"].append(args[6])
        return launch(name, *args, stream=stream)

    fake_lib.launch = recording
    wgrad, act_f, act_b = cb.weight_grad, cb.act_forward, cb.act_backward

    def spy_wgrad(a, b, *rest, **kw):
        rec["wgrad"].append((a.clone(), b.clone()))
        return wgrad(a, b, *rest, **kw)

    def spy_act(*a, **kw):
        h = act_f(*a, **kw)
        rec["act"].append(h.clone())
        return h

    def spy_dact(*a, **kw):
        out = act_b(*a, **kw)
        rec["dact"].append(tuple(t.clone() for t in out))
        return out

    monkeypatch.setattr(cb, "weight_grad", spy_wgrad)
    monkeypatch.setattr(cb, "act_forward", spy_act)
    monkeypatch.setattr(cb, "act_backward", spy_dact)
    rec["quantiser"] = quantiser
    return rec


def _run(precision, problem, **kw):
    x, ids, w, dy, W13, W2, b13, b2 = problem
    args = (W13, W2, b13, b2, "swiglu", None)
    y, saved = cb.experts_forward(x, ids, w, *args, precision=precision)
    dx, dtk, g = cb.experts_backward(dy, saved, x, ids, w, *args, precision=precision, **kw)
    return (y, dx, dtk, g.gate_up_proj, g.down_proj), saved.sched


def _segments(sched):
    """(start, routed rows) of each expert's segment, from the schedule's sizes."""
    ends, rows = sched.seg_end.tolist(), sched.seg_rows.tolist()
    return [(end - (end - prev), n) for prev, end, n in zip([0] + ends[:-1], ends, rows)]


def _rows_of(t, sched, T_):
    """t [T, K] in schedule order: t's row of each routed row, zeros on padding rows (as the gather gives)."""
    idx = sched.row_token.clamp(max=T_ - 1)
    return torch.where((sched.row_token < T_).unsqueeze(1), t[idx], torch.zeros((), dtype=t.dtype))


def _routed_equal(got, want, sched, T_):
    real = sched.row_token < T_
    return torch.equal(got[real], want[real])


def test_every_gemm_takes_the_mxfp8_operands(spied):
    problem = _problem(seed=1)
    x, ids, w, dy, W13, W2, _, _ = problem
    _, sched = _run("mxfp8", problem)
    names = [n for n, _, _ in spied["gemm"]]
    assert len(names) == 4, names  # gate/up, down, dgrad of down, dgrad of gate/up (the plain kernels here)
    (_, a1, b1), (_, a2, b2), (_, a3, b3), (_, a4, b4) = spied["gemm"]
    # forward: x and W13 along H; h and W2 along I
    assert _routed_equal(a1, _rows_of(fake_quantize(x, -1), sched, T), sched, T)
    assert torch.equal(b1, fake_quantize(W13, -1).permute(1, 2, 0))
    (h,) = spied["act"]
    assert _routed_equal(a2, fake_quantize(h, -1), sched, T)
    assert torch.equal(b2, fake_quantize(W2, -1).permute(1, 2, 0))
    # backward: d y and W2 along H (W2 column-wise); d gate_up and W13 along 2I (W13 column-wise)
    assert _routed_equal(a3, _rows_of(fake_quantize(dy, -1), sched, T), sched, T)
    assert torch.equal(b3, fake_quantize(W2, -2).permute(2, 1, 0))
    dgu, wh, _ = spied["dact"][0]
    assert _routed_equal(a4, fake_quantize(dgu, -1), sched, T)
    assert torch.equal(b4, fake_quantize(W13, -2).permute(2, 1, 0))
    # the operands differ from the bf16 ones (the test can tell them apart)
    assert not torch.equal(b1, W13.permute(1, 2, 0)) and not _routed_equal(a2, h, sched, T)
    # with the kernel: x, W13, h, W2 along their columns (forward); d y, W2 along its rows, d y (taken from d y
    # itself into schedule order; on this first use also gathered, then quantised: the check) and w h in
    # schedule blocks (the down weight's gradient), d gate_up along its columns and in blocks (one launch), W13
    # along its rows, x in blocks (taken from x)
    expected = [0, 0, 0, 0, 0, 1, 4, 2, 2, 3, 1, 4] if spied["quantiser"] == "kernel" else []
    assert spied["mx"] == expected


def test_weight_gradients_take_per_expert_blocks_of_rows(spied):
    """d W2 = dY^T (w h) and d W13 = dGU^T X, every operand in blocks of 32 of the expert's rows from its first
    one (the last block zero-padded): fake_quantize_padded per expert, against what the kernel was given."""
    problem = _problem(seed=2)
    x, ids, w, dy, *_ = problem
    _, sched = _run("mxfp8", problem)
    dgu, wh, _ = spied["dact"][0]
    (a_down, b_down), (a_up, b_up) = spied["wgrad"]
    unquantised = ((_rows_of(dy, sched, T), wh), (dgu, _rows_of(x, sched, T)))
    for (got_a, got_b), (ua, ub) in zip(((a_down, b_down), (a_up, b_up)), unquantised):
        for start, n in _segments(sched):
            seg = slice(start, start + n)
            assert torch.equal(got_a[seg], fake_quantize_padded(ua[seg], 0))
            assert torch.equal(got_b[seg], fake_quantize_padded(ub[seg], 0))
        assert not torch.equal(got_a[:n], ua[:n])  # quantised: not the rows themselves


def test_row_segments_fall_back_where_the_one_pass_disagrees(quantiser, fake_lib, monkeypatch):
    """row_segments' one-pass mode is checked against gathering then quantising on its first use: a kernel that
    gives other bits is not used (a warning), and the weight gradients stay those of the two passes."""
    problem = _problem(seed=6)
    want, _ = _run("mxfp8", problem)
    if quantiser == "torch":  # (no kernel runs: nothing to check)
        return
    monkeypatch.setattr(cuda_mx, "_VERDICTS", {})
    launch = fake_lib.launch

    def off_by_one_ulp(name, *args, stream):
        launch(name, *args, stream=stream)
        if name == "mok_mx_quant" and args[6] == cb.MX_ROW_SEGMENTS:
            src, dst, row_src = args[0], args[1].view(torch.int16), args[5]
            dst[int((row_src < src.shape[0]).nonzero()[0]), 0] += 1  # a wrong bit in the first routed row

    fake_lib.launch = off_by_one_ulp
    with pytest.warns(RuntimeWarning, match="row segments.*gathered, then quantised"):
        got, _ = _run("mxfp8", problem)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert cuda_mx._VERDICTS[("mok_mx_quant (row segments)", "cpu")] is False


def test_segments_ignore_what_padding_rows_hold(quantiser):
    """GemmOperands.segments treats rows that are not routed rows as zeros, whatever a kernel left there
    (NaN, huge values): each expert's blocks are those of its routed rows alone."""
    g = torch.Generator().manual_seed(3)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    sched = cb.make_schedule_torch(ids, E)
    rows = torch.randn(sched.capacity, 96, generator=g).bfloat16()
    real = cb.real_rows(sched)
    assert int(real.sum()) == T * K
    junk = rows.clone()
    junk[~real] = float("nan")
    junk[~real][::2] = 1e30
    got = cb.GemmOperands("mxfp8").segments(junk, sched)
    for start, n in _segments(sched):
        assert torch.equal(got[start:start + n], fake_quantize_padded(rows[start:start + n], 0))
    assert torch.equal(got[~real], torch.zeros_like(got[~real]))


def _model(problem):
    """y, d x, d topk-weights, d W13, d W2 of the MXFP8 definition in float64 (tests/test_mxfp8_layer.py's
    per-expert model), for these sizes."""
    import test_mxfp8_layer as m

    x, ids, w, dy, W13, W2, _, _ = problem
    zeros13, zeros2 = torch.zeros(E, 2 * I), torch.zeros(E, H)
    sizes = {"T": T, "H": H, "I": I, "E": E, "K": K}
    saved = {k: getattr(m, k) for k in sizes}
    try:
        for k, v in sizes.items():
            setattr(m, k, v)
        y, dx, dw, dw13, dw2, _, _ = m.model(x, ids, w, (W13, W2, zeros13, zeros2), dy, "swiglu", None)
    finally:
        for k, v in saved.items():
            setattr(m, k, v)
    return y, dx, dw, dw13, dw2


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _reference(problem):
    from mok_nn import reference

    x, ids, w, dy, W13, W2, _, _ = problem
    args = (W13, W2, None, None, "swiglu", None)
    y, saved = reference.experts_forward(x, ids, w, *args, precision="mxfp8")
    dx, dtk, g = reference.experts_backward(dy, saved, x, ids, w, *args, precision="mxfp8")
    return y, dx, dtk, g.gate_up_proj, g.down_proj


def test_function_against_the_reference_and_float64_and_bitwise_repeatable(quantiser):
    """The whole forward and backward: bitwise the same on a second run; against the reference path's MXFP8
    (fp32 sums, the same bf16 roundings) within summation rounding, and far closer to it than the bf16 path;
    within the bf16 roundings of the float64 model. d W2 is looser: its operand w h is rounded to bf16 before it
    is quantised (as the bf16 path stores it), where the reference quantises the fp32 product."""
    problem = _problem(seed=4)
    got, _ = _run("mxfp8", problem)
    again, _ = _run("mxfp8", problem)
    plain, _ = _run("bf16", problem)
    ref, model = _reference(problem), _model(problem)
    for name, a, b, p, r, m in zip(("y", "dx", "d_topk", "d_W13", "d_W2"), got, again, plain, ref, model):
        assert torch.equal(a, b), name
        err, err_bf16 = _rel(a, r), _rel(p, r)
        assert err < (3e-2 if name == "d_W2" else 1e-4), (name, err)
        assert err_bf16 > (2 if name == "d_W2" else 100) * max(err, 1e-6), (name, err, err_bf16)
        assert _rel(a, m) < 2e-2, (name, _rel(a, m))


def test_frozen_weights_skip_the_quantised_weight_gradients(spied):
    """needs=(False, False, ...): no weight-gradient operand is quantised or launched; d x keeps its bits."""
    problem = _problem(seed=5)
    full, _ = _run("mxfp8", problem)
    spied["wgrad"].clear()
    frozen, _ = _run("mxfp8", problem, needs=(False, False, True, True))
    assert spied["wgrad"] == [] and frozen[3] is None and frozen[4] is None
    assert torch.equal(frozen[1], full[1]) and torch.equal(frozen[2], full[2])


def test_unknown_precision_is_refused(quantiser):
    x, ids, w, dy, W13, W2, b13, b2 = _problem(seed=6)
    with pytest.raises(ValueError, match="precision"):
        cb.experts_forward(x, ids, w, W13, W2, precision="fp8")


def test_schedule_call_gathers_the_mxfp8_rows(quantiser, monkeypatch):
    """With precision="mxfp8" the schedule's call gathers x's MXFP8 values (build_schedule), which the gate/up
    GEMM takes as they are: no other gather of x in the forward (the backward takes x's columns into schedule
    order for the weight gradient: row_segments), and the same bits as without the schedule's gather."""
    from types import SimpleNamespace

    problem = _problem(seed=8)
    x, ids, w, dy, W13, W2, _, _ = problem
    args = (W13, W2, None, None, "swiglu", None)

    def schedule_gathering(topk_ids, num_experts, capacity=None, gather_x=None, gather_mx=False):
        sched = cb.make_schedule_torch(topk_ids, num_experts, capacity)
        if gather_x is not None:  # as mok_schedule_gather does on the GPU
            rows = cb.gather_rows(gather_x, sched, mx=gather_mx)
            sched.gathered = (gather_x, rows, "mxfp8" if gather_mx else "bf16")
        return sched

    monkeypatch.setattr(cb, "make_schedule", schedule_gathering)
    ws = SimpleNamespace(precision="mxfp8", ep_size=1, num_experts=E)
    sched = cb.build_schedule(ids, ws, x)
    assert sched.gathered[0] is x and sched.gathered[2] == "mxfp8"
    gathers = []
    gather = cb.gather_rows
    monkeypatch.setattr(cb, "gather_rows", lambda t, *a, **kw: gathers.append(t) or gather(t, *a, **kw))
    segments = []
    row_segments = cb.row_segments
    monkeypatch.setattr(cb, "row_segments", lambda t, *a: segments.append(t) or row_segments(t, *a))
    y, saved = cb.experts_forward(x, ids, w, *args, sched=sched, precision="mxfp8")
    assert gathers == [] and segments == [] and sched.gathered is None
    back = cb.experts_backward(dy, saved, x, ids, w, *args, precision="mxfp8")
    assert any(t is x or t._base is x for t in segments)  # x's columns taken for d W13
    assert not any(t is x or t._base is x for t in gathers)
    y2, saved2 = cb.experts_forward(x, ids, w, *args, precision="mxfp8")
    back2 = cb.experts_backward(dy, saved2, x, ids, w, *args, precision="mxfp8")
    assert torch.equal(y, y2) and torch.equal(back[0], back2[0])
    assert torch.equal(back[2].gate_up_proj, back2[2].gate_up_proj)


def test_frozen_mxfp8_backward_gathers_no_plain_rows(spied, monkeypatch):
    """Frozen weights without biases: the backward gathers d y's MXFP8 values only (gather_rows(mx=True); the plain
    d y rows would feed d W2 and the bias terms alone); the same d x and d topk-weights."""
    problem = _problem(seed=9)
    x, ids, w, dy, *_ = problem
    full, _ = _run("mxfp8", problem)
    gathered = []
    gather = cb.gather_rows
    def spy(t, sched, skip_tail=False, mx=False):
        gathered.append((t, mx))
        return gather(t, sched, skip_tail, mx)

    monkeypatch.setattr(cb, "gather_rows", spy)
    frozen, _ = _run("mxfp8", problem, needs=(False, False, True, True))
    of_dy = [mx for t, mx in gathered if torch.equal(t, dy)]
    assert of_dy and all(of_dy)  # d y gathered as its MXFP8 values only
    assert torch.equal(frozen[1], full[1]) and torch.equal(frozen[2], full[2])
