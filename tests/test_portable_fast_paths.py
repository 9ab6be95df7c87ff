"""The portable backend's fast paths, each against what it replaces on fresh random inputs: the few-pass
activation / combine helpers against reference.py's formulas, the router's keyed top-k against the stable sort,
the MXFP8 weight cache (reuse, invalidation on any in-place update, bounded memory, determinism)."""

import pytest
import torch

from mok_nn import mxfp8, torch_backend


# --- the few-pass elementwise helpers (activation, combine, inverse permutation)


def _bits(t):
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64],
                         ids=["bf16", "f16", "f32", "f64"])
@pytest.mark.parametrize("activation,limit", [("swiglu", None), ("swiglu", 0.37), ("swiglu_oai", None),
                                              ("swiglu_oai", 7.0)])
def test_activation_helpers_match_reference(activation, limit, dtype):
    """torch_backend.activation_forward / activation_backward compute reference's activation on gate_up converted
    to the compute dtype, rounded once to the storage dtype: bit for bit where I is a multiple of the SIMD width
    (same ops, same order, same vectorised loops), within one rounding of the compute dtype elsewhere (torch's
    scalar tail loop of sigmoid / silu may round differently from its vector loop). Fresh inputs whose clamp
    (limit) and both signs are exercised; the inputs are left unchanged."""
    from mok_nn import reference

    cdt = reference.compute_dtype(dtype)
    g = torch.Generator().manual_seed(3 + 7 * (activation == "swiglu_oai") + int(11 * (limit or 0)))
    for inter, exact in ((64, True), (10, False)):
        gate_up = (torch.randn(97, 2 * inter, generator=g) * 3).to(dtype)
        grad_h = torch.randn(97, inter, generator=g).to(cdt)
        keep = gate_up.clone(), grad_h.clone()
        got = (torch_backend.activation_forward(gate_up, activation, limit),
               torch_backend.activation_backward(gate_up, grad_h, activation, limit))
        want = (reference.activation_forward(gate_up.to(cdt), activation, limit).to(dtype),
                reference.activation_backward(gate_up.to(cdt), grad_h, activation, limit).to(dtype))
        assert torch.equal(gate_up, keep[0]) and torch.equal(grad_h, keep[1])
        for a, b in zip(got, want):
            assert a.dtype == dtype and a.shape == b.shape
            if exact:
                assert torch.equal(_bits(a), _bits(b))
            else:
                # measured: at most 1.4 eps of the largest value (silu's tail loop, fp32 / float64 storage)
                err = (a.to(torch.float64) - b.to(torch.float64)).abs().max()
                assert err <= 4 * torch.finfo(dtype).eps * b.abs().max().to(torch.float64)
        if limit is not None:  # the clamp is active on some values
            assert (gate_up.to(cdt).abs() > limit).any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("top_k", [1, 2, 3, 4])
def test_combine_and_sum_slots_are_the_reference_sums(top_k, dtype):
    """combine_slots / sum_slots: the reference's fixed-order fp32 sums, bit for bit (up to the sign of a zero
    sum: the reference starts from +0)."""
    from mok_nn import reference

    g = torch.Generator().manual_seed(top_k)
    slots = torch.randn(33, top_k, 40, generator=g).to(dtype)
    w = torch.rand(33, top_k, generator=g)
    for got, want in ((torch_backend.combine_slots(slots, w, dtype), reference.combine_slots(slots, w, dtype)),
                      (torch_backend.sum_slots(slots, dtype), reference.sum_slots(slots, dtype))):
        assert got.dtype == dtype and torch.equal(_bits(got + 0.0), _bits(want + 0.0))
    # k products summed in j order, not another order: a sum whose order shows
    big = torch.zeros(1, top_k, 40, dtype=dtype)
    if top_k >= 3:
        big[0, 0], big[0, 1], big[0, 2] = 2.0**30, -(2.0**30), 1.0
        assert torch.equal(torch_backend.sum_slots(big, dtype), reference.sum_slots(big, dtype))
        assert torch_backend.sum_slots(big, dtype)[0, 0] == 1.0


def test_inverse_permutation():
    g = torch.Generator().manual_seed(0)
    for n in (0, 1, 77):
        order = torch.randperm(n, generator=g)
        inv = torch_backend.inverse_permutation(order)
        assert torch.equal(inv, torch.argsort(order))


# --- the router's top-k: unique int64 keys through torch.topk, the stable sort's choice


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64],
                         ids=["f32", "bf16", "f16", "f64"])
def test_keyed_topk_is_the_stable_sort(dtype):
    """stable_topk_indices == the first k of a stable descending sort, order included, on values full of ties,
    -0 / +0, +-inf, NaN of both signs and subnormals (fp32 and 16-bit run the keyed top-k, float64 the sort); the
    keyed form itself too, which the CPU runs (the GPU sorts)."""
    from mok_nn.router import stable_topk_indices, topk_by_keys

    g = torch.Generator().manual_seed(7)
    for _ in range(60):
        n = int(torch.randint(1, 70, (1,), generator=g))
        k = int(torch.randint(1, n + 1, (1,), generator=g))
        v = torch.randint(-3, 4, (40, n), generator=g).float() * 0.5
        m = torch.rand(40, n, generator=g)
        for lo, hi, val in ((0, .05, -0.0), (.05, .08, float("nan")), (.08, .1, float("inf")),
                            (.1, .12, -float("inf")), (.12, .14, -float("nan")), (.14, .16, 1e-40),
                            (.16, .18, -1e-40), (.18, .2, 0.0)):
            v[(m >= lo) & (m < hi)] = val
        v = v.to(dtype)
        want = torch.sort(v, dim=-1, descending=True, stable=True).indices[..., :k]
        assert torch.equal(stable_topk_indices(v, k), want)
        assert torch.equal(topk_by_keys(v, k), want)
    # random scores, no ties: also the plain top-k
    s = torch.softmax(torch.randn(300, 32, generator=g), -1).to(dtype)
    assert torch.equal(stable_topk_indices(s, 4), torch.sort(s, dim=-1, descending=True, stable=True).indices[:, :4])


# --- MXFP8: fake_quantize_fast against fake_quantize on the E4M3 grid's ties


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["f32", "bf16", "f16"])
def test_fast_fake_quantize_rounds_ties_to_even(dtype):
    """Blocks whose scaled values lie on E4M3 grid points and exactly half-way between them, in every binade of
    E4M3 (subnormals included), both signs, block scales 2^-140..2^120 (subnormal results included), along the
    last axis, the first axis and a middle axis of a 3-D tensor: bit for bit fake_quantize (mxfp8.py's bytes
    path), signs of zeros and NaN blocks included."""
    from mok_nn.mxfp8 import fake_quantize, fake_quantize_fast

    g = torch.Generator().manual_seed(5)
    for _ in range(60):
        e = int(torch.randint(-140, 120, (1,), generator=g)) if dtype != torch.float16 else \
            int(torch.randint(-20, 6, (1,), generator=g))
        k = torch.randint(0, 16, (64, 32), generator=g).float()
        expo = torch.randint(-9, 9, (64, 32), generator=g).float()
        half = 0.5 * (torch.rand(64, 32, generator=g) < 0.5).float()
        v = (8 + k + half) * torch.exp2(expo - 3)  # E4M3 normals and mid-points
        sub = torch.randint(0, 16, (64, 32), generator=g).float() * 2.0**-10  # subnormal grid and mid-points
        v = torch.where(torch.rand(64, 32, generator=g) < 0.3, sub, v) * torch.randn(64, 32, generator=g).sign()
        v[:, 0] = 448.0 * (0.5 + 0.5 * torch.rand(64, generator=g))  # each row block's amax in (224, 448]
        v[1, 5] = float("nan")
        x = (v.double() * 2.0**e).to(dtype)
        for t, axis in ((x, -1), (x.t().contiguous(), 0), (x.view(4, 16, 32).transpose(1, 2).contiguous(), 1)):
            a, b = fake_quantize(t, axis), fake_quantize_fast(t, axis)
            assert a.dtype == b.dtype == dtype
            assert torch.equal(a.isnan(), b.isnan()) and a.isnan().any()
            num = ~a.isnan()  # (a NaN's sign bit means nothing: the two routes may differ there)
            assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)) and torch.equal(a.signbit()[num],
                                                                                     b.signbit()[num])


# --- MXFP8: the expert weights' quantised values, cached per weight tensor and version


def _mx_layer(seed=0, **kw):
    from helpers import ACTIVATIONS, ROUTINGS, make_layer

    opts = {**ROUTINGS["softmax_norm"], **ACTIVATIONS["oai"]}
    kw = {"precision": "mxfp8", **kw}
    return make_layer(opts, dtype=torch.bfloat16, seed=seed, hidden=64, inter=32, experts=8, top_k=2,
                      backend="torch", **kw)


def _count_weight_quantisations(monkeypatch):
    """Counts fake_quantize_fast calls on 3-D operands (the expert weights; activations are 2-D)."""
    calls = []
    real = torch_backend.fake_quantize_fast

    def counting(t, axis=-1):
        if t.dim() == 3:
            calls.append(axis)
        return real(t, axis)

    monkeypatch.setattr(mxfp8, "fake_quantize_fast", counting)
    return calls


def _run(layer, x, dy):
    from helpers import layer_forward_backward

    return layer_forward_backward(layer, x, dy)


def _same(a, b):
    (ya, ga), (yb, gb) = a, b
    return torch.equal(ya, yb) and all((ga[n] is None and gb[n] is None) or torch.equal(ga[n], gb[n]) for n in ga)


def _freeze(layer):
    layer.experts.gate_up_proj.requires_grad_(False)
    layer.experts.down_proj.requires_grad_(False)
    return layer


def test_mxfp8_weight_cache_reuses_and_is_bitwise_the_uncached_result(monkeypatch):
    """Frozen weights: the four weight operands are quantised once (forward and backward axes of both weights),
    then reused call after call; cached or freshly quantised, every output and gradient is the same bits; and the
    values are MXFP8 ones (they differ from precision="bf16")."""
    from helpers import random_x

    mxfp8.clear_weight_cache()
    calls = _count_weight_quantisations(monkeypatch)
    layer = _freeze(_mx_layer())
    x, dy = random_x((70, 64), torch.bfloat16, 1), random_x((70, 64), torch.bfloat16, 2)
    first = _run(layer, x, dy)
    assert sorted(calls) == [-2, -2, -1, -1]
    for _ in range(3):
        assert _same(_run(layer, x, dy), first)
    assert len(calls) == 4  # no weight quantised again
    mxfp8.clear_weight_cache()
    assert _same(_run(layer, x, dy), first) and len(calls) == 8
    bf16 = _freeze(_mx_layer(precision="bf16"))
    assert not torch.equal(_run(bf16, x, dy)[0], first[0])


def test_trained_weights_are_quantised_once_per_forward_and_backward(monkeypatch):
    """Trained weights: no copy kept between calls (an optimizer step would make it stale); inside one call each
    weight is quantised once per axis, however many macrobatch passes it runs; the same bits as frozen ones."""
    from helpers import random_x

    from mok_nn import MoKConfig

    mxfp8.clear_weight_cache()
    calls = _count_weight_quantisations(monkeypatch)
    x, dy = random_x((70, 64), torch.bfloat16, 1), random_x((70, 64), torch.bfloat16, 2)
    for config in (None, MoKConfig(macrobatch_size=16)):  # one pass; five
        calls.clear()
        layer = _mx_layer(config=config)
        got = _run(layer, x, dy)
        assert sorted(calls) == [-2, -2, -1, -1]
        _run(layer, x, dy)
        assert sorted(calls) == [-2, -2, -2, -2, -1, -1, -1, -1]
        assert len(mxfp8._MX_WEIGHTS) == 0
    frozen = _run(_freeze(_mx_layer()), x, dy)
    assert torch.equal(frozen[0], _run(_mx_layer(), x, dy)[0])


@pytest.mark.parametrize("how", ["in_place_add", "copy_", "optimizer_step", "load_state_dict", "new_storage",
                                 "through_a_view"])
def test_mxfp8_weight_cache_sees_every_update(how):
    """After the weights change (in place, by an optimizer, load_state_dict, new storage, a write through a view)
    the next call uses the new values: bit for bit a fresh layer with those weights, with an empty cache."""
    from helpers import random_state, random_x

    mxfp8.clear_weight_cache()
    layer = _mx_layer(seed=3)
    x, dy = random_x((50, 64), torch.bfloat16, 4), random_x((50, 64), torch.bfloat16, 5)
    before = _run(layer, x, dy)
    e = layer.experts
    with torch.no_grad():
        if how == "in_place_add":
            e.gate_up_proj.add_(0.25 * e.gate_up_proj)
            e.down_proj.mul_(1.5)
        elif how == "copy_":
            e.down_proj.copy_(torch.randn(e.down_proj.shape, generator=torch.Generator().manual_seed(6)))
        elif how == "load_state_dict":
            layer.load_state_dict(random_state(layer, 7))
        elif how == "new_storage":
            e.gate_up_proj.data = e.gate_up_proj.data * 0.5
        elif how == "through_a_view":
            e.down_proj[1:3].mul_(-2.0)
    if how == "optimizer_step":
        opt = torch.optim.AdamW(layer.parameters(), lr=0.05)
        opt.step()  # the gradients of `before`
    after = _run(layer, x, dy)
    assert not torch.equal(after[0], before[0])
    fresh = _mx_layer(seed=3)
    fresh.load_state_dict(layer.state_dict())
    mxfp8.clear_weight_cache()
    assert _same(_run(fresh, x, dy), after)


def test_mxfp8_weight_cache_is_bounded_and_goes_with_its_weights():
    """Frozen weights changed between calls (e.g. an EMA): at most one entry per weight tensor and axis, old values
    replaced; the entries go when the layer goes (weak keys), nothing accumulates across layers built and
    dropped; trained weights keep none."""
    import gc

    from helpers import random_x

    mxfp8.clear_weight_cache()
    layer = _freeze(_mx_layer(seed=8))
    x, dy = random_x((40, 64), torch.bfloat16, 9), random_x((40, 64), torch.bfloat16, 10)
    for _ in range(4):
        _run(layer, x, dy)
        with torch.no_grad():
            layer.experts.down_proj.mul_(0.99)
    cache = mxfp8._MX_WEIGHTS
    assert len(cache) == 2 and all(len(v) == 2 for v in cache.values())
    assert {id(k) for k in cache.keys()} == {id(layer.experts.gate_up_proj), id(layer.experts.down_proj)}
    for _ in range(3):
        _run(_freeze(_mx_layer(seed=11)), x, dy)
        _run(_mx_layer(seed=12), x, dy)
    gc.collect()
    assert len(cache) == 2
    del layer
    gc.collect()
    assert len(cache) == 0


@pytest.mark.parametrize("shape,axis", [((5088, 256), 0), ((4100, 96), -1), ((9, 256, 160), -2), ((96, 4096), 0)])
def test_fast_fake_quantize_in_chunks(shape, axis):
    """Tensors over fake_quantize_fast's chunk size (about 1 MiB of fp32 along dim 0, whole blocks): the same values
    as fake_quantize, the last chunk shorter, NaN blocks included."""
    from mok_nn.mxfp8 import fake_quantize, fake_quantize_fast

    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=g) * torch.exp2(torch.randn(shape, generator=g) * 8)).to(torch.bfloat16)
    x.view(-1)[[7, x.numel() - 3]] = float("nan")
    a, b = fake_quantize(x, axis), fake_quantize_fast(x, axis)
    assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(3.0), b.nan_to_num(3.0))


def test_chunking_changes_no_bit_and_gpus_take_few_chunks(monkeypatch):
    """The chunked passes (activation, its backward, the combine's sums, the MXFP8 quantisation) give the same bits
    whatever the chunk size: tiny chunks against one chunk, a training step of the layer at precision "mxfp8". On a
    GPU the chunks are 256 MiB (1 MiB there would cost a launch per op per MiB), on CPU 1 MiB."""
    from helpers import random_x

    x, dy = random_x((70, 64), torch.bfloat16, 1), random_x((70, 64), torch.bfloat16, 2)
    runs = []
    for size in (256, 1 << 30):
        monkeypatch.setattr(mxfp8, "chunk_bytes", lambda device, size=size: size)
        mxfp8.clear_weight_cache()
        runs.append(_run(_mx_layer(), x, dy))
    assert _same(runs[0], runs[1])
    monkeypatch.undo()
    assert len(mxfp8.row_chunks(65536, 4 * 768, torch.device("cuda"))) == 1
    assert len(mxfp8.row_chunks(65536, 4 * 768, torch.device("cpu"))) == 193  # 341 rows each


def test_weight_scope_is_per_thread():
    """A weight_scope kept open in one thread does not serve (or get closed by) another thread's calls."""
    import threading

    w = torch.randn(2, 64, 32).requires_grad_(True)
    seen = {}

    def other():
        seen["outside"] = mxfp8.weight_values(w, -1) is not mxfp8.weight_values(w, -1)  # no scope here: fresh
        with mxfp8.weight_scope():
            seen["inside"] = mxfp8.weight_values(w, -1) is mxfp8.weight_values(w, -1)  # kept in its own scope

    with mxfp8.weight_scope():
        first = mxfp8.weight_values(w, -1)
        t = threading.Thread(target=other)
        t.start()
        t.join()
        assert mxfp8.weight_values(w, -1) is first  # this thread's scope still open and intact
    assert seen == {"outside": True, "inside": True}


# --- the Triton kernels' first-use check (mok_nn.triton_ops.verified): a kernel form that fails or disagrees is
# not used, with a warning, and the torch ops run in its place


def test_a_triton_form_that_disagrees_or_fails_is_not_used(monkeypatch):
    from mok_nn import mxfp8, triton_ops

    monkeypatch.setattr(triton_ops, "_VERDICTS", {})
    monkeypatch.setattr(triton_ops, "runs_on", lambda t: True)  # as on a CUDA device
    x = torch.randn(96, 64, generator=torch.Generator().manual_seed(0)).bfloat16()
    want = mxfp8.fake_quantize(x, -1)
    calls = []

    def wrong(t, axis):
        calls.append(t.shape[0])
        return torch.zeros_like(t)

    monkeypatch.setattr(triton_ops, "fake_quantize", wrong)
    with pytest.warns(RuntimeWarning, match="disagree"):
        got = mxfp8.fake_quantize_fast(x, -1)
    assert torch.equal(got, want) and calls == [64]  # checked on 64 rows, then never used
    assert torch.equal(mxfp8.fake_quantize_fast(x, -1), want) and calls == [64]

    def broken(t, axis):
        raise RuntimeError("no such instruction")

    monkeypatch.setattr(triton_ops, "fake_quantize", broken)
    with pytest.warns(RuntimeWarning, match="no such instruction"):
        assert torch.equal(mxfp8.fake_quantize_fast(x, 0), mxfp8.fake_quantize(x, 0))  # another form: checked anew


def test_a_triton_form_that_agrees_is_checked_once(monkeypatch):
    from mok_nn import mxfp8, triton_ops

    monkeypatch.setattr(triton_ops, "_VERDICTS", {})
    monkeypatch.setattr(triton_ops, "runs_on", lambda t: True)
    calls = []

    def right(t, axis):
        calls.append(t.shape[0])
        return mxfp8._fake_quantize_chunks(t, axis)

    monkeypatch.setattr(triton_ops, "fake_quantize", right)
    x = torch.randn(96, 64, generator=torch.Generator().manual_seed(0)).bfloat16()
    for _ in range(3):
        assert torch.equal(mxfp8.fake_quantize_fast(x, -1), mxfp8.fake_quantize(x, -1))
    assert calls == [64, 96, 96, 96]  # the check once, then the kernel on the whole


def test_agreement_rule_of_the_first_use_check():
    from mok_nn.triton_ops import _agree

    a = torch.tensor([1.0, float("nan"), -0.0])
    assert _agree(a, a.clone(), exact=True)
    assert not _agree(a, torch.tensor([1.0, float("nan"), 0.0]), exact=True)  # the sign of a zero
    assert not _agree(a, torch.tensor([1.0, 2.0, -0.0]), exact=True)  # NaN where NaN
    b = torch.randn(100, generator=torch.Generator().manual_seed(1)).bfloat16()
    assert _agree(b, (b.float() * (1 + 1e-3)).bfloat16(), exact=False)
    assert not _agree(b, (b.float() * 1.05).bfloat16(), exact=False)
    assert not _agree(b, None, exact=False) and _agree(None, None, exact=False)
