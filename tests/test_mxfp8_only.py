"""MXFP8-only expert weights (MoKMoELayer.quantize_experts_, mxfp8_experts=True, checkpoint loading): the layer
computes with W_q = dequantize(stored) (against the float64 oracle, and bitwise against a layer holding W_q as
parameters), is deterministic, round-trips its state dict, loads every checkpoint format without a copy in the
layer dtype, and refuses to train the weights."""

import copy
import io
import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import oracle
import test_mxfp8_layer
from helpers import assert_close, random_state, random_x, single_thread  # noqa: F401
from mok_nn import MoKMoELayer, checkpoint, functional, mxfp8
from mok_nn.autograd import MoKFunction
from mok_nn.layer import MXFP8Weight
from mok_nn.mxfp8 import MXFP8Tensor, fake_quantize, quantize

H, I, E, K, T = 64, 32, 8, 2, 29
PREFIX = "model.layers.0.mlp."
MX_KEYS = ("experts.gate_up_proj", "experts.gate_up_proj_scale", "experts.down_proj", "experts.down_proj_scale")


def np_dequant(data: torch.Tensor, scale: torch.Tensor) -> np.ndarray:
    """Independent dequantisation (numpy ldexp of the float64 element values), blocks of 32 along the last dim."""
    d = data.view(torch.float8_e4m3fn).double().numpy()
    s = np.repeat(scale.numpy().astype(np.int64) - 127, 32, axis=-1)
    return np.ldexp(d, s)


def w_q(layer, name):
    """float64 W_q of an MXFP8-only layer's weight, dequantised independently of mok_nn."""
    e = layer.experts
    return torch.from_numpy(np_dequant(e._buffers[name], e._buffers[name + "_scale"]))


def holds_only_mxfp8(layer) -> bool:
    """No floating expert weight in the layer dtype: the weights are E4M3 data + uint8 scales (buffers)."""
    e = layer.experts
    weights = {n: t for n, t in list(e.named_parameters()) + list(e.named_buffers()) if "bias" not in n}
    return (e.mxfp8_only and sorted(weights) == sorted(k.split(".", 1)[1] for k in MX_KEYS)
            and all(t.dtype in (torch.float8_e4m3fn, torch.uint8) for t in weights.values())
            and all(not n.endswith("proj") for n, _ in e.named_parameters()))


def make(backend="reference", precision="bf16", dtype=torch.bfloat16, seed=0, bias=False, **kw):
    """A layer with random state (helpers.random_state scales), then quantize_experts_()."""
    layer = MoKMoELayer(H, I, E, K, backend=backend, precision=precision, dtype=dtype, expert_proj_bias=bias, **kw)
    layer.load_state_dict(random_state(layer, seed))
    return layer.quantize_experts_()


def step(layer, x, dy):
    """y, d x, d router weight and the parameters' gradients of sum(y * dy)."""
    x = x.detach().clone().requires_grad_(True)
    layer.zero_grad(set_to_none=True)
    y = layer(x)
    (y * dy).sum().backward()
    return [y.detach(), x.grad] + [p.grad for _, p in layer.named_parameters()]


# ----------------------------------------------------------------------------- the function


@pytest.mark.parametrize("opts", [dict(activation="swiglu"),
                                  dict(activation="swiglu_oai", swiglu_limit=7.0, bias=True, router_bias=True)],
                         ids=["swiglu", "oai_bias"])
@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_matches_float64_oracle_on_w_q(backend, opts):
    """precision="bf16", fp32 layer: the oracle (tests/oracle.py) on W_q dequantised with numpy; y, d x, d router
    (and the trainable biases) within fp32 rounding."""
    opts = dict(opts)
    bias = opts.pop("bias", False)
    layer = make(backend, "bf16", torch.float32, seed=5, bias=bias, **opts)
    x, dy = random_x((T, H), torch.float32, 6), random_x((T, H), torch.float32, 7)
    got = step(layer, x, dy)

    p = {k: v.double() for k, v in layer.state_dict().items() if k not in MX_KEYS}
    p["experts.gate_up_proj"], p["experts.down_proj"] = w_q(layer, "gate_up_proj"), w_q(layer, "down_proj")
    trained = [n for n, _ in layer.named_parameters()]
    for n in trained:
        p[n].requires_grad_(True)
    x64 = x.double().requires_grad_(True)
    okw = {k: v for k, v in opts.items() if k in ("activation", "swiglu_limit")}
    res = oracle.oracle_forward(x64, p, top_k=K, **okw)
    assert res.margin > 1e-5, "near-tie in the routing: pick another seed"
    want = [res.y] + list(torch.autograd.grad((res.y * dy.double()).sum(), [x64] + [p[n] for n in trained]))
    assert trained[0] == "router.weight" and len(got) == len(want)
    for name, a, b in zip(["y", "x"] + trained, got, want):
        assert_close(a, b, 5e-6, name)
    # W_q is not the fp32 weight it was quantised from (so the comparison above is one on W_q), and
    # dequantize_experts_ gives it back as parameters
    dense = MoKMoELayer(H, I, E, K, dtype=torch.float32, expert_proj_bias=bias, **opts)
    unquantised = random_state(dense, 5)["experts.gate_up_proj"].double()
    assert (unquantised - p["experts.gate_up_proj"]).abs().max() > 1e-3 * unquantised.abs().max()
    ref = make(backend, "bf16", torch.float32, seed=5, bias=bias, **opts).dequantize_experts_()
    assert torch.equal(ref.experts.gate_up_proj.detach().double(), p["experts.gate_up_proj"])


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_mxfp8_precision_matches_float64_model(backend):
    """precision="mxfp8" on MXFP8-only weights (fp32): the routed experts (MoKFunction with the E4M3 data and E8M0
    scales) against test_mxfp8_layer's float64 model of docs/mxfp8.md on W_q: y, d x, d topk-weights. The
    dgrad GEMMs quantise W_q column-wise (a second quantisation): the model with W_q unquantised there is
    told apart."""
    m = test_mxfp8_layer
    x, ids, w, (w13, w2, b13, b2), dy = m._inputs(0)
    q13, q2 = quantize(w13), quantize(w2)
    wq13, wq2 = (torch.from_numpy(np_dequant(q.data, q.scale)) for q in (q13, q2))
    ws = functional.get_workspace(hidden_size=m.H, intermediate_size=m.I, num_experts=m.E, top_k=m.K, device="cpu",
                                  dtype=torch.float32, backend=backend, precision="mxfp8")
    xg, wg = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    y = MoKFunction.apply(xg, wg, q13.data, q2.data, b13, b2, ids, ws, q13.scale, q2.scale)
    (y * dy).sum().backward()
    want = m.model(x, ids, w, (wq13, wq2, b13, b2), dy, "swiglu", None)
    no_second_q = m.model(x, ids, w, (wq13, wq2, b13, b2), dy, "swiglu", None, q_w_bwd_axis=1)
    for name, a, b, c in zip(("y", "dx", "d_topk"), (y, xg.grad, wg.grad), want[:3], no_second_q[:3]):
        err = m._rel(a, b)
        assert err < 1e-6, (name, err)
        if name != "y":
            assert m._rel(c, b) > 10 * max(err, 1e-8), name


@pytest.mark.parametrize("precision", ["bf16", "mxfp8"])
@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_bitwise_a_layer_holding_w_q_and_deterministic(backend, precision):
    """The MXFP8-only layer computes bitwise what a layer holding W_q as bf16 parameters computes (y, d x,
    d router, biases), run after run; its expert weights get no gradient."""
    mx = make(backend, precision, seed=1, bias=True)
    dense = make(backend, precision, seed=1, bias=True).dequantize_experts_()
    assert holds_only_mxfp8(mx) and not dense.experts.mxfp8_only
    x, dy = random_x((T, H), torch.bfloat16, 2), random_x((T, H), torch.bfloat16, 3)
    a, a2, b = step(mx, x, dy), step(mx, x, dy), step(dense, x, dy)
    names = [n for n, _ in mx.named_parameters()]
    assert names == ["router.weight", "experts.gate_up_proj_bias", "experts.down_proj_bias"]
    for i, name in enumerate(["y", "x"] + names):
        assert torch.equal(a[i], a2[i]), name
        assert torch.equal(a[i], b[i]), name
    assert mx.experts.gate_up_proj.grad is None and mx.experts.down_proj.grad is None
    assert dense.experts.gate_up_proj.grad is not None


def test_backward_takes_the_values_along_n_a_few_experts_at_a_time(monkeypatch):
    """With precision="mxfp8" the backward reads MXFP8-only weights only as its d x / d h GEMMs' operands, W_q's
    MXFP8 values along N: it gets those (fake_quantize of the dequantised weights along N, marked as such),
    dequantised a few experts at a time, so that no whole copy of W_q is held beside them."""
    import types

    from mok_nn import autograd

    e = make("torch", "mxfp8", seed=1).experts
    calls = []
    real = autograd.dequantize
    monkeypatch.setattr(autograd, "dequantize", lambda t, dtype: calls.append(t.data.shape[0]) or real(t, dtype))
    monkeypatch.setattr(mxfp8, "chunk_bytes", lambda device: 3 * 2 * I * H * 2)  # three experts of W13 in bf16
    ws = types.SimpleNamespace(backend="torch", precision="mxfp8")
    w13, w2 = autograd.backward_expert_weights(e.gate_up_proj, e.down_proj, e.gate_up_proj_scale, e.down_proj_scale,
                                               torch.bfloat16, ws)
    full13, full2 = e.dequantized_weights(torch.bfloat16)
    assert torch.equal(w13, fake_quantize(full13, axis=-2)) and torch.equal(w2, fake_quantize(full2, axis=-2))
    assert mxfp8.weight_values(w13, -2) is w13 and mxfp8.weight_values(w2, -2) is w2
    assert calls[:3] == [3, 3, 2] and max(calls) < E  # W13 in chunks of whole experts (W2: rows half as long)
    # in bf16 precision the GEMMs take W_q itself
    w13_bf16, _ = autograd.backward_expert_weights(e.gate_up_proj, e.down_proj, e.gate_up_proj_scale,
                                                   e.down_proj_scale, torch.bfloat16,
                                                   types.SimpleNamespace(backend="torch", precision="bf16"))
    assert torch.equal(w13_bf16, full13)


def test_constructed_mxfp8_only_and_init():
    """MoKMoELayer(mxfp8_experts=True) holds MXFP8 from the start; under one seed its weights are the rceil
    quantisation of the bf16 layer's (CPU); quantize_experts_ keeps every bit of quantize()."""
    torch.manual_seed(0)
    dense = MoKMoELayer(H, I, E, K)
    torch.manual_seed(0)
    mx = MoKMoELayer(H, I, E, K, mxfp8_experts=True)
    assert holds_only_mxfp8(mx) and "mxfp8_experts=True" in repr(mx)
    w13 = dense.experts.gate_up_proj.detach().clone()
    dense.quantize_experts_()
    q = quantize(w13)
    assert torch.equal(dense.experts.gate_up_proj.view(torch.uint8), q.data.view(torch.uint8))
    assert torch.equal(dense.experts.gate_up_proj_scale, q.scale)
    for k, v in dense.state_dict().items():
        assert torch.equal(v.view(torch.uint8) if v.dtype == torch.float8_e4m3fn else v,
                           mx.state_dict()[k].view(torch.uint8) if v.dtype == torch.float8_e4m3fn
                           else mx.state_dict()[k]), k
    assert torch.equal(mx.experts.dequantized_weights()[0], fake_quantize(w13))


def test_memory_held():
    """E4M3 data, 1 byte a value, and an E8M0 byte per 32: (1 + 1/32) / 2 = 0.516 of bf16."""
    layer = MoKMoELayer(H, I, E, K)
    dense = sum(p.numel() * p.element_size() for p in layer.experts.parameters())
    layer.quantize_experts_()
    held = sum(b.numel() * b.element_size() for b in layer.experts.buffers())
    assert held / dense == (1 + 1 / 32) / 2


def test_memory_script(capsys):
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parents[1] / "benchmarks" / "mxfp8_weight_memory.py"
    spec = importlib.util.spec_from_file_location("mxfp8_weight_memory", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--hidden", "64", "--intermediate", "32", "--experts", "4"]) == 0
    out = capsys.readouterr().out
    assert "ratio 0.5156" in out


# ----------------------------------------------------------------------------- state dict, casts, copies


def test_state_dict_round_trip(tmp_path):
    src = make("torch", "mxfp8", seed=2, bias=True)
    x, dy = random_x((T, H), torch.bfloat16, 4), random_x((T, H), torch.bfloat16, 5)
    want = step(src, x, dy)
    sd = src.state_dict()
    assert set(MX_KEYS) <= set(sd) and sd["experts.gate_up_proj"].dtype == torch.float8_e4m3fn
    assert sd["experts.gate_up_proj_scale"].shape == (E, 2 * I, H // 32)
    assert type(sd["experts.gate_up_proj"]) is torch.Tensor  # a plain tensor in the state dict
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    for assign in (False, True):
        dst = MoKMoELayer(H, I, E, K, backend="torch", precision="mxfp8", expert_proj_bias=True, mxfp8_experts=True)
        dst.load_state_dict(torch.load(io.BytesIO(buf.getvalue())), assign=assign)
        assert isinstance(dst.experts.gate_up_proj, MXFP8Weight)
        for name, a, b in zip(["y", "x"], step(dst, x, dy), want):
            assert torch.equal(a, b), name
    # the state dict saved with safetensors is a checkpoint mok_nn reads (format "mxfp8", no config)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(tmp_path / "layer.safetensors"))
    assert checkpoint.detect_format(tmp_path / "layer.safetensors") == checkpoint.FORMAT_MXFP8
    dst = MoKMoELayer(H, I, E, K, backend="torch", precision="mxfp8", expert_proj_bias=True, mxfp8_experts=True)
    dst.load_state_dict({k: v for k, v in sd.items() if not k.startswith("experts.")}, strict=False)
    checkpoint.load_experts_into_layer(dst, tmp_path / "layer.safetensors")
    assert torch.equal(step(dst, x, dy)[0], want[0])


def test_state_dict_of_the_other_kind_is_refused():
    mx, dense = make(), MoKMoELayer(H, I, E, K)
    with pytest.raises(RuntimeError, match="holds MXFP8-only expert weights"):
        mx.load_state_dict(dense.state_dict(), strict=False)
    with pytest.raises(RuntimeError, match="holds MXFP8 data"):
        dense.load_state_dict(mx.state_dict(), strict=False)


def test_module_casts_copies_and_pickling():
    layer = make()
    bits = layer.experts.gate_up_proj.view(torch.uint8).clone()
    layer.float()
    assert layer.experts.gate_up_proj.dtype == torch.float8_e4m3fn and layer.experts.weight_dtype == torch.float32
    assert isinstance(layer.experts.gate_up_proj, MXFP8Weight)
    assert torch.equal(layer.experts.gate_up_proj.view(torch.uint8), bits)
    y32 = layer(random_x((T, H), torch.float32, 1))
    assert y32.dtype == torch.float32
    layer.to(torch.bfloat16)
    assert layer.experts.weight_dtype == torch.bfloat16
    for other in (copy.deepcopy(layer), torch.load(_saved(layer), weights_only=False)):
        assert isinstance(other.experts.gate_up_proj, MXFP8Weight) and other.experts.mxfp8_only
        assert torch.equal(other.experts.gate_up_proj.view(torch.uint8), bits)
        x = random_x((T, H), torch.bfloat16, 2)
        assert torch.equal(other(x), layer(x))
    meta = MoKMoELayer(H, I, E, K, device="meta", mxfp8_experts=True)
    meta.to_empty(device="cpu")
    meta.reset_parameters()
    assert meta.experts.gate_up_proj.device.type == "cpu" and meta.experts.gate_up_proj_scale.any()


def _saved(module):
    buf = io.BytesIO()
    torch.save(module, buf)
    buf.seek(0)
    return buf


# ----------------------------------------------------------------------------- errors, backends, training


def test_training_the_weights_is_refused_with_the_way_out():
    layer = make()
    for attempt in (lambda w: w.requires_grad_(True), lambda w: w.requires_grad_(),
                    lambda w: setattr(w, "requires_grad", True)):
        with pytest.raises(RuntimeError, match=r"MXFP8-only frozen expert weights.*dequantize_experts_"):
            attempt(layer.experts.down_proj)
    layer.experts.down_proj.requires_grad_(False)  # (freezing is fine)
    assert [n for n, _ in layer.named_parameters()] == ["router.weight"]
    # forced past the checks: the forward refuses
    torch.Tensor.requires_grad_(layer.experts.gate_up_proj, True)
    with pytest.raises(RuntimeError, match="MXFP8-only frozen"):
        layer(random_x((T, H), torch.bfloat16, 1))
    torch.Tensor.requires_grad_(layer.experts.gate_up_proj, False)
    # the way out: trainable parameters holding W_q
    w13 = w_q(layer, "gate_up_proj")
    layer.dequantize_experts_()
    assert isinstance(layer.experts.gate_up_proj, torch.nn.Parameter) and layer.experts.gate_up_proj.requires_grad
    assert torch.equal(layer.experts.gate_up_proj.detach().double(), w13)
    layer(random_x((T, H), torch.bfloat16, 1)).sum().backward()
    assert layer.experts.gate_up_proj.grad is not None


def test_backend_choice_on_cpu_and_what_the_cuda_check_is_asked(monkeypatch):
    """On the CPU: backend='cuda' refused (no CUDA input), auto takes the portable backend. On CUDA the fused path
    takes MXFP8-only layers: its check is asked about the weights the GEMMs will get, W_q in x's dtype (the
    float8 data itself would be refused as not bf16)."""
    from mok_nn import cuda_backend

    layer = make()
    layer.backend = "cuda"
    with pytest.raises(RuntimeError, match="need a CUDA device"):
        layer(random_x((T, H), torch.bfloat16, 1))
    layer.backend = "auto"
    assert layer._choose_backend(random_x((T, H), torch.bfloat16, 1)) == "torch"
    asked = []
    monkeypatch.setattr(cuda_backend, "unavailable_reason", lambda x, ids, w13, w2, act: asked.append((w13, w2)))
    x = torch.empty(T, H, dtype=torch.bfloat16, device="meta")
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    assert cuda_backend.unsupported_reason(layer, x) is None
    (w13, w2), = asked
    assert (w13.dtype, w2.dtype) == (torch.bfloat16, torch.bfloat16)
    assert tuple(w13.shape) == (E, 2 * I, H) and tuple(w2.shape) == (E, H, I)


def test_quantize_experts_requirements():
    with pytest.raises(ValueError, match="multiples of the MX block size"):
        MoKMoELayer(48, 32, E, K).quantize_experts_()
    with pytest.raises(TypeError, match="bfloat16, float16, float32"):
        MoKMoELayer(H, I, E, K, dtype=torch.float64).quantize_experts_()
    with pytest.raises(TypeError, match="bfloat16, float16, float32"):
        MoKMoELayer(H, I, E, K, dtype=torch.float64, mxfp8_experts=True)
    with pytest.raises(ValueError, match="scale_mode"):
        MoKMoELayer(H, I, E, K).quantize_experts_("nearest")
    layer = MoKMoELayer(H, I, E, K).quantize_experts_("floor")
    assert layer.quantize_experts_() is layer and layer.experts.mxfp8_only  # idempotent


# ----------------------------------------------------------------------------- checkpoints


def _bf16_weights(seed):
    g = torch.Generator().manual_seed(seed)
    spread = lambda *s: torch.randn(*s, generator=g) * torch.exp2(torch.randn(*s[:-1], 1, generator=g))  # noqa: E731
    return (spread(E, 2 * I, H) / H**0.5).bfloat16(), (spread(E, H, I) / I**0.5).bfloat16()


def _block_fp8(w, pow2, seed):
    """128x128 block FP8 of w [E, N, K] (as tests/test_checkpoint.py): (fp8 data, fp32 scale_inv)."""
    g = torch.Generator().manual_seed(seed)
    n, k = w.shape[-2:]
    s = torch.rand(w.shape[0], -(-n // 128), -(-k // 128), generator=g) * 0.01 + 0.002
    if pow2:
        s = torch.exp2(torch.round(torch.log2(s)))
    full = s.repeat_interleave(128, 1).repeat_interleave(128, 2)[:, :n, :k]
    return (w.float() / full).clamp(-448, 448).to(torch.float8_e4m3fn), s


def _formats(tmp_path, w13, w2):
    """{format: (source, expected W_q of gate_up_proj and down_proj as fp32, MX format)}."""
    out = {}
    q13, q2 = quantize(w13), quantize(w2)
    fq = (q13.dequantize(torch.float32), q2.dequantize(torch.float32))
    ours = tmp_path / "ours.safetensors"
    checkpoint.save_mxfp8(ours, checkpoint.quantize_expert_weights(
        {PREFIX + "experts.gate_up_proj": w13, PREFIX + "experts.down_proj": w2}))
    out["mok_nn"] = (ours, fq, True)
    # compressed-tensors, per-expert modules, "floor" scales (an OCP producer)
    ct, floor13, floor2 = {}, [], []
    for e in range(E):
        parts = []
        for role, m in (("gate_proj", w13[e, :I]), ("up_proj", w13[e, I:]), ("down_proj", w2[e])):
            q = quantize(m, scale_mode="floor")
            ct[f"{PREFIX}experts.{e}.{role}.weight"], ct[f"{PREFIX}experts.{e}.{role}.weight_scale"] = q.data, q.scale
            parts.append(q.dequantize(torch.float32))
        floor13.append(torch.cat(parts[:2]))
        floor2.append(parts[2])
    d = tmp_path / "ct"
    d.mkdir()
    save_file(ct, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps({"quantization_config": {
        "quant_method": "compressed-tensors", "format": "mxfp8-quantized"}}))
    out["compressed-tensors"] = (d, (torch.stack(floor13), torch.stack(floor2)), True)
    # ModelOpt fused w13 / w2, FP8 data stored as uint8
    d = tmp_path / "mo"
    d.mkdir()
    save_file({PREFIX + "experts.w13_weight": q13.data.view(torch.uint8), PREFIX + "experts.w13_weight_scale": q13.scale,
               PREFIX + "experts.w2_weight": q2.data.view(torch.uint8), PREFIX + "experts.w2_weight_scale": q2.scale},
              str(d / "model.safetensors"))
    (d / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "MXFP8"}}))
    out["modelopt"] = (d, fq, True)
    # the same layout without a config, as a raw dict
    out["mxfp8"] = ({PREFIX + "experts.gate_up_proj": q13.data, PREFIX + "experts.gate_up_proj_scale": q13.scale,
                     PREFIX + "experts.down_proj": q2.data, PREFIX + "experts.down_proj_scale": q2.scale}, fq, True)
    # transformers fine-grained FP8, ue8m0 (power-of-two 128x128 scales): lossless to MXFP8
    # DeepSeek-V3 block FP8 (non-power-of-two scales): requantised to MXFP8 at load
    for name, pow2 in (("fp8-block-ue8m0", True), ("fp8-block", False)):
        t, vals = {}, []
        for proj, w, seed in (("gate_up_proj", w13, 1), ("down_proj", w2, 2)):
            data, s = _block_fp8(w, pow2, seed)
            t[PREFIX + f"experts.{proj}"], t[PREFIX + f"experts.{proj}_scale_inv"] = data, s
            vals.append(quantize(checkpoint.dequantize_block_fp8(data, s, (128, 128))).dequantize(torch.float32))
        cfg = {"quant_method": "fp8", "weight_block_size": [128, 128], **({"scale_fmt": "ue8m0"} if pow2 else {})}
        d = tmp_path / name
        d.mkdir()
        save_file(t, str(d / "model.safetensors"))
        (d / "config.json").write_text(json.dumps({"quantization_config": cfg}))
        out[name] = (d, tuple(vals), False)  # (ue8m0: dequantised to fp32 once to check the conversion)
    out["unquantized"] = ({PREFIX + "experts.gate_up_proj": w13, PREFIX + "experts.down_proj": w2}, fq, False)
    return out


def test_every_checkpoint_format_loads_as_mxfp8_only(tmp_path, monkeypatch):
    """Each format read by mok_nn.checkpoint gives an MXFP8-only layer with the expected W_q: from MXFP8 formats
    (and ue8m0 block FP8) the stored values, which for a checkpoint written from quantize(W) are W_q of
    quantize_experts_ on W; DeepSeek block FP8 requantised to MXFP8 once; never dequantised into the layer dtype
    (the MX formats are not dequantised at all)."""
    w13, w2 = _bf16_weights(3)
    ref = MoKMoELayer(H, I, E, K)
    with torch.no_grad():
        ref.experts.gate_up_proj.copy_(w13)
        ref.experts.down_proj.copy_(w2)
    ref.quantize_experts_()
    for fmt, (src, (want13, want2), mx) in _formats(tmp_path, w13, w2).items():
        layer = MoKMoELayer(H, I, E, K, mxfp8_experts=True)
        with monkeypatch.context() as mp:
            if mx:  # the MX formats' bits go in as they are: nothing is dequantised
                def refuse(*a, **k):
                    raise AssertionError(f"{fmt}: dequantised while loading")
                mp.setattr(mxfp8, "dequantize", refuse)
                mp.setattr(MXFP8Tensor, "dequantize", refuse)
            checkpoint.load_experts_into_layer(layer, src, PREFIX)
        assert holds_only_mxfp8(layer), fmt
        assert torch.equal(w_q(layer, "gate_up_proj"), want13.double()), fmt
        assert torch.equal(w_q(layer, "down_proj"), want2.double()), fmt
        if fmt in ("mok_nn", "modelopt", "mxfp8", "unquantized"):  # written from quantize(W): quantize_experts_'s bits
            for k in MX_KEYS:
                a, b = layer.state_dict()[k], ref.state_dict()[k]
                assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (fmt, k)
    # an existing bf16 layer turned MXFP8-only by the loader (its parameters dropped unconverted), and back
    layer = MoKMoELayer(H, I, E, K)
    checkpoint.load_experts_into_layer(layer, tmp_path / "ours.safetensors", PREFIX, mxfp8_only=True)
    assert holds_only_mxfp8(layer) and torch.equal(w_q(layer, "gate_up_proj"), w_q(ref, "gate_up_proj"))
    checkpoint.load_experts_into_layer(layer, tmp_path / "ours.safetensors", PREFIX, mxfp8_only=False)
    assert isinstance(layer.experts.gate_up_proj, torch.nn.Parameter)
    assert torch.equal(layer.experts.gate_up_proj.detach().double(), w_q(ref, "gate_up_proj"))


def test_checkpoint_shard_and_column_wise_layout(tmp_path):
    """EP rank 1 of 2 takes experts [E/2, E); a column-wise MXFP8 tensor (save_mxfp8 keeps the axis) is
    requantised row-wise at load."""
    from types import SimpleNamespace

    w13, w2 = _bf16_weights(4)
    local = MoKMoELayer(H, I, E // 2, K, mxfp8_experts=True)
    fake = SimpleNamespace(experts=local.experts, num_experts=E, num_local_experts=E // 2, ep_rank=1,
                           hidden_size=H, intermediate_size=I, precision="bf16")
    col = quantize(w13, axis=1)
    checkpoint.save_mxfp8(tmp_path / "c.safetensors", {"experts.gate_up_proj": col,
                                                        "experts.down_proj": quantize(w2)})
    checkpoint.load_experts_into_layer(fake, tmp_path / "c.safetensors")
    assert torch.equal(w_q(local, "down_proj"), quantize(w2).dequantize(torch.float64)[E // 2:])
    assert torch.equal(w_q(local, "gate_up_proj"),
                       quantize(col.dequantize(torch.float32)).dequantize(torch.float64)[E // 2:])


def test_mxfp8_precision_forward_takes_w_q_without_requantising(monkeypatch):
    """precision="mxfp8" on MXFP8-only weights: the forward's weight operands are W_q itself (it is MXFP8 along
    that axis), the backward's W_q's values along N, made from the stored data (backward_expert_weights), with no
    quantisation pass in the GEMMs' operands; the same bits as requantising each along its axis."""
    from mok_nn import autograd
    from test_portable_fast_paths import _count_weight_quantisations

    def run():
        layer = make(precision="mxfp8", backend="torch")
        x = random_x((T, H), torch.bfloat16, 3).requires_grad_(True)
        y = layer(x)
        y.float().pow(2).sum().backward()
        return y.detach(), x.grad

    calls = _count_weight_quantisations(monkeypatch)
    marked = run()
    assert calls == []  # every weight operand already marked as its values along its GEMM's axis
    calls.clear()
    monkeypatch.setattr(autograd, "mark_values", lambda w, axis: None)
    requantised = run()
    assert sorted(calls) == [-2, -2, -1, -1]
    assert all(torch.equal(a, b) for a, b in zip(marked, requantised))
