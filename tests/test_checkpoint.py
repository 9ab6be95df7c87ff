"""Checkpoint I/O: round trips for every supported format, built here from scratch."""

import json
import re

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from mok_nn import checkpoint as ck
from mok_nn.mxfp8 import MXFP8Tensor, quantize

E, I, H = 3, 64, 96
PREFIX = "model.layers.0.mlp."


def _rand(*shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * torch.exp2(torch.randn(shape[:-1] + (1,), generator=g))


def _np_dequant_mx(data: torch.Tensor, scale: torch.Tensor, axis: int = -1) -> np.ndarray:
    """Independent dequantisation: numpy ldexp of the float64 element values."""
    d = data.view(torch.float8_e4m3fn).double().numpy()
    s = np.repeat(scale.numpy().astype(np.int64) - 127, 32, axis=axis)
    return np.ldexp(d, s)


def _write(dirpath, tensors, config=None, config_name="config.json", metadata=None):
    dirpath.mkdir(exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dirpath / "model.safetensors"), metadata=metadata)
    if config is not None:
        (dirpath / config_name).write_text(json.dumps(config))
    return dirpath


def _experts_fp32():
    return _rand(E, 2 * I, H, seed=1), _rand(E, H, I, seed=2)


def _extra():
    return {PREFIX + "gate.weight": _rand(E, H, seed=3).bfloat16(), "model.norm.weight": torch.ones(H)}


def _check_experts(loaded, gate_up_ref, down_ref, prefix=PREFIX):
    """expert_weights() assembled [E,2I,H]/[E,H,I] MXFP8 with the expected values (numpy dequant)."""
    gu, dn = ck.expert_weights(loaded, prefix)
    assert isinstance(gu, MXFP8Tensor) and isinstance(dn, MXFP8Tensor)
    assert gu.shape == (E, 2 * I, H) and dn.shape == (E, H, I) and gu.axis == 2 and dn.axis == 2
    np.testing.assert_array_equal(_np_dequant_mx(gu.data, gu.scale), gate_up_ref)
    np.testing.assert_array_equal(_np_dequant_mx(dn.data, dn.scale), down_ref)
    for k, v in _extra().items():
        if k in loaded:
            assert torch.equal(loaded[k], v)


# ----------------------------------------------------------------------------- our format


def test_mok_format_round_trip(tmp_path):
    gu, dn = _experts_fp32()
    qgu, qdn = quantize(gu.bfloat16()), quantize(dn, scale_mode="floor")
    col = quantize(dn, axis=-2)  # column-wise must round-trip with its axis
    tensors = {PREFIX + "experts.gate_up_proj": qgu, PREFIX + "experts.down_proj": qdn,
               PREFIX + "experts.down_proj_colwise": col, **_extra()}
    path = tmp_path / "m.safetensors"
    ck.save_mxfp8(path, tensors, metadata={"source": "test", "step": 7})
    raw, meta, _ = ck.read_safetensors(path)
    assert meta["format"] == "mok_nn.mxfp8" and meta["source"] == "test" and meta["step"] == "7"
    assert raw[PREFIX + "experts.gate_up_proj_scale"].dtype == torch.uint8
    assert raw[PREFIX + "experts.gate_up_proj"].dtype == torch.float8_e4m3fn
    assert ck.detect_format(path) == ck.FORMAT_MOK
    loaded = ck.load_mxfp8_tensors(path)
    assert set(loaded) == set(tensors)
    for name, t in tensors.items():
        got = loaded[name]
        if isinstance(t, MXFP8Tensor):
            assert got.axis == t.axis and got.block_size == t.block_size
            assert torch.equal(got.data.view(torch.uint8), t.data.view(torch.uint8))
            assert torch.equal(got.scale, t.scale)
        else:
            assert torch.equal(got, t) and got.dtype == t.dtype
    _check_experts(loaded, _np_dequant_mx(qgu.data, qgu.scale), _np_dequant_mx(qdn.data, qdn.scale))
    np.testing.assert_array_equal(loaded[PREFIX + "experts.down_proj_colwise"].dequantize(torch.float64).numpy(),
                                  _np_dequant_mx(col.data, col.scale, axis=1))


def test_sharded_directory_keeps_each_shards_layout(tmp_path):
    """Shards written by save_mxfp8 each carry the layouts of their own tensors: a directory of them
    keeps every tensor's axis and block size (column-wise in one shard, row-wise / blocks of 16 in
    another); shards that give one tensor different layouts raise naming it."""
    w = torch.randn(2, 64, 96)
    col, row, b16 = quantize(w, axis=1), quantize(w * 3, axis=-1), quantize(w / 5, axis=-1, block_size=16)
    d = tmp_path / "shards"
    d.mkdir()
    ck.save_mxfp8(d / "model-00001-of-00002.safetensors", {"a.col": col, "a.b16": b16})
    ck.save_mxfp8(d / "model-00002-of-00002.safetensors", {"b.row": row, "b.bias": w[0, 0]})
    loaded = ck.load_mxfp8_tensors(d)
    assert set(loaded) == {"a.col", "a.b16", "b.row", "b.bias"}
    for name, t, axis, bs in (("a.col", col, 1, 32), ("b.row", row, 2, 32), ("a.b16", b16, 2, 16)):
        got = loaded[name]
        assert (got.axis, got.block_size) == (axis, bs)
        want = np.ldexp(t.data.double().numpy(), np.repeat(t.scale.numpy().astype(np.int64) - 127, bs, axis=axis))
        np.testing.assert_array_equal(got.dequantize(torch.float64).numpy(), want)
    assert torch.equal(loaded["b.bias"], w[0, 0])
    # the same tensor's layout stated differently by two shards: an error naming it
    meta1 = {"format": "mok_nn.mxfp8", "mxfp8": json.dumps({"a.col": {"axis": 1, "block_size": 32}})}
    meta2 = {"format": "mok_nn.mxfp8", "mxfp8": json.dumps({"a.col": {"axis": 2, "block_size": 32}})}
    bad = tmp_path / "bad"
    bad.mkdir()
    save_file({"a.col": col.data, "a.col_scale": col.scale}, str(bad / "a.safetensors"), metadata=meta1)
    save_file({"x": w}, str(bad / "b.safetensors"), metadata=meta2)
    with pytest.raises(ck.CheckpointFormatError, match="'a.col'"):
        ck.load_mxfp8_tensors(bad)


def test_save_rejects_bad_input(tmp_path):
    q = quantize(torch.randn(4, 32))
    with pytest.raises(ValueError, match="used twice"):
        ck.save_mxfp8(tmp_path / "a.safetensors", {"w": q, "w_scale": torch.zeros(2)})
    with pytest.raises(ValueError, match="reserved"):
        ck.save_mxfp8(tmp_path / "a.safetensors", {"w": q}, metadata={"format": "x"})
    with pytest.raises(TypeError, match="'w'"):
        ck.save_mxfp8(tmp_path / "a.safetensors", {"w": np.zeros(3)})


# ----------------------------------------------------------------------------- MX formats of others


def _per_expert_mx(gu, dn, scale_dtype=torch.uint8, data_as_uint8=False, names=("gate_proj", "up_proj", "down_proj")):
    """Per-expert Linear modules: weight + weight_scale, quantised (floor, as an OCP producer would)."""
    tensors, refs_gu, refs_dn = {}, [], []
    for e in range(E):
        mats = {names[0]: gu[e, :I], names[1]: gu[e, I:], names[2]: dn[e]}
        for role, w in mats.items():
            q = quantize(w, scale_mode="floor")
            base = f"{PREFIX}experts.{e}.{role}.weight"
            tensors[base] = q.data.view(torch.uint8) if data_as_uint8 else q.data
            tensors[base + "_scale"] = q.scale.view(scale_dtype)
        refs_gu.append(np.concatenate([_np_dequant_mx(*_q(tensors, f"{PREFIX}experts.{e}.{r}.weight"))
                                       for r in names[:2]], 0))
        refs_dn.append(_np_dequant_mx(*_q(tensors, f"{PREFIX}experts.{e}.{names[2]}.weight")))
    return tensors, np.stack(refs_gu), np.stack(refs_dn)


def _q(tensors, name):
    return tensors[name], tensors[name + "_scale"].view(torch.uint8)


CT_CONFIG = {"model_type": "qwen3_moe", "quantization_config": {
    "quant_method": "compressed-tensors", "format": "mxfp8-quantized",
    "config_groups": {"group_0": {"format": "mxfp8-quantized", "targets": ["Linear"],
                                  "weights": {"num_bits": 8, "type": "float", "strategy": "group",
                                              "group_size": 32}}}}}


@pytest.mark.parametrize("scale_dtype", [torch.uint8, torch.float8_e8m0fnu])
def test_compressed_tensors(tmp_path, scale_dtype):
    gu, dn = _experts_fp32()
    tensors, ref_gu, ref_dn = _per_expert_mx(gu, dn, scale_dtype)
    d = _write(tmp_path / "ct", {**tensors, **_extra()}, CT_CONFIG)
    assert ck.detect_format(d) == ck.FORMAT_COMPRESSED_TENSORS
    loaded = ck.load_mxfp8_tensors(d)
    assert not any(k.endswith("_scale") for k in loaded)
    _check_experts(loaded, ref_gu, ref_dn)
    # without config the same layout is still recognised
    assert ck.detect_format(tensors) == ck.FORMAT_MXFP8


def test_modelopt_fused_and_uint8_data(tmp_path):
    gu, dn = _experts_fp32()
    q13, q2 = quantize(gu), quantize(dn)
    tensors = {PREFIX + "experts.w13_weight": q13.data.view(torch.uint8), PREFIX + "experts.w13_weight_scale": q13.scale,
               PREFIX + "experts.w2_weight": q2.data, PREFIX + "experts.w2_weight_scale": q2.scale, **_extra()}
    hf_quant = {"producer": {"name": "modelopt", "version": "0.0"},
                "quantization": {"quant_algo": "MXFP8", "kv_cache_quant_algo": None}}
    d = _write(tmp_path / "mo", tensors, hf_quant, "hf_quant_config.json")
    assert ck.detect_format(d) == ck.FORMAT_MODELOPT
    loaded = ck.load_mxfp8_tensors(d)
    _check_experts(loaded, _np_dequant_mx(q13.data, q13.scale), _np_dequant_mx(q2.data, q2.scale))
    # quantization_config form, per-expert Mixtral names (w1/w3/w2)
    t2, ref_gu, ref_dn = _per_expert_mx(gu, dn, names=("w1", "w3", "w2"))
    cfg = {"quantization_config": {"quant_method": "modelopt", "quant_algo": "MXFP8"}}
    d2 = _write(tmp_path / "mo2", t2, cfg)
    assert ck.detect_format(d2) == ck.FORMAT_MODELOPT
    _check_experts(ck.load_mxfp8_tensors(d2), ref_gu, ref_dn)


# ----------------------------------------------------------------------------- block FP8


def _block_fp8(w: torch.Tensor, block, pow2: bool, seed: int):
    """Block-FP8 encoding of w: returns (fp8 data, scale_inv float32, exact fp64 value of the encoding)."""
    bn, bk = block
    n, k = w.shape[-2:]
    sn, sk = -(-n // bn), -(-k // bk)
    g = torch.Generator().manual_seed(seed)
    s = torch.rand(*w.shape[:-2], sn, sk, generator=g) * 0.01 + 0.002
    if pow2:
        s = torch.exp2(torch.round(torch.log2(s)))
    s_full = np.kron(s.double().numpy(), np.ones((bn, bk)))[..., :n, :k]
    data = torch.from_numpy(np.clip(w.double().numpy() / s_full, -448, 448)).float().to(torch.float8_e4m3fn)
    return data, s.float(), data.double().numpy() * s_full


def test_transformers_fp8_ue8m0_lossless(tmp_path):
    gu, dn = _experts_fp32()
    gu_d, gu_s, gu_val = _block_fp8(gu, (128, 128), True, 4)
    dn_d, dn_s, dn_val = _block_fp8(dn, (128, 128), True, 5)
    tensors = {PREFIX + "experts.gate_up_proj": gu_d, PREFIX + "experts.gate_up_proj_scale_inv": gu_s,
               PREFIX + "experts.down_proj": dn_d, PREFIX + "experts.down_proj_scale_inv": dn_s, **_extra()}
    cfg = {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128], "scale_fmt": "ue8m0"}}
    d = _write(tmp_path / "tf", tensors, cfg)
    assert ck.detect_format(d) == ck.FORMAT_FP8_UE8M0
    assert ck.detect_format(tensors) == ck.FORMAT_FP8_UE8M0
    loaded = ck.load_mxfp8_tensors(d)
    _check_experts(loaded, gu_val, dn_val)  # lossless: values identical
    # [1, 32] blocks with E8M0 bytes as scale_inv: exactly MXFP8
    q = quantize(gu)
    t2 = {PREFIX + "experts.gate_up_proj": q.data, PREFIX + "experts.gate_up_proj_scale_inv": q.scale,
          PREFIX + "experts.down_proj": dn_d, PREFIX + "experts.down_proj_scale_inv": dn_s}
    cfg2 = {"quantization_config": {"quant_method": "fp8", "scale_fmt": "ue8m0"}}  # block size inferred
    _check_experts(ck.load_mxfp8_tensors(t2, cfg2), _np_dequant_mx(q.data, q.scale), dn_val)


def test_deepseek_block_fp8_requantised(tmp_path):
    # N, K not multiples of 128 (partial blocks); K a multiple of 32
    w = _rand(200, 160, seed=6)
    data, s, val = _block_fp8(w, (128, 128), False, 7)
    tensors = {"model.layers.3.self_attn.o_proj.weight": data, "model.layers.3.self_attn.o_proj.weight_scale_inv": s}
    gu, dn = _experts_fp32()
    vals = {}
    for e in range(E):
        for role, m in (("gate_proj", gu[e, :I]), ("up_proj", gu[e, I:]), ("down_proj", dn[e])):
            name = f"{PREFIX}experts.{e}.{role}.weight"
            tensors[name], tensors[name + "_scale_inv"], vals[name] = _block_fp8(m, (128, 128), False, 8 + e)
    cfg = {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                   "weight_block_size": [128, 128]}}
    d = _write(tmp_path / "ds", {**tensors, **_extra()}, cfg)
    assert ck.detect_format(d) == ck.FORMAT_FP8_BLOCK
    assert ck.detect_format(tensors) == ck.FORMAT_FP8_BLOCK
    loaded = ck.load_mxfp8_tensors(d)
    q = loaded["model.layers.3.self_attn.o_proj.weight"]
    assert isinstance(q, MXFP8Tensor) and q.shape == (200, 160) and q.scale.shape == (200, 5)
    # requantisation of the exact block-FP8 value (fp32-representable) with the MX rule
    ref = quantize(torch.from_numpy(val).float())
    assert torch.equal(q.data.view(torch.uint8), ref.data.view(torch.uint8)) and torch.equal(q.scale, ref.scale)
    err = np.abs(_np_dequant_mx(q.data, q.scale) - val)
    e = np.repeat(q.scale.numpy().astype(np.float64) - 127, 32, axis=-1)
    assert np.all(err <= np.maximum(np.abs(val) * 2.0**-4, np.exp2(e - 10))) and err.max() > 0
    gu_ref = np.stack([np.concatenate([vals[f"{PREFIX}experts.{e}.gate_proj.weight"],
                                       vals[f"{PREFIX}experts.{e}.up_proj.weight"]]) for e in range(E)])
    got_gu, _ = ck.expert_weights(loaded, PREFIX)
    rel = np.abs(_np_dequant_mx(got_gu.data, got_gu.scale) - gu_ref).max() / np.abs(gu_ref).max()
    assert 0 < rel < 2.0**-4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_deepseek_block_fp8_into_bf16_layer_is_dequantised_directly(tmp_path, dtype):
    """A precision="bf16" layer gets block FP8 (non-power-of-two scales) as fp8 * scale_inv multiplied in
    fp32 and cast once to its dtype (numpy here), bitwise; a precision="mxfp8" layer gets the MXFP8
    requantisation of those values; both from a directory and from a raw dict."""
    from mok_nn import MoKMoELayer

    gu, dn = _experts_fp32()
    seed = int(torch.randint(0, 2**30, ()))
    tensors, f32 = {}, {}
    for e in range(E):
        for r, (role, m) in enumerate((("gate_proj", gu[e, :I]), ("up_proj", gu[e, I:]), ("down_proj", dn[e]))):
            name = f"{PREFIX}experts.{e}.{role}.weight"
            data, s, _ = _block_fp8(m, (128, 128), False, seed + 3 * e + r)
            tensors[name], tensors[name + "_scale_inv"] = data, s
            s_full = np.kron(s.numpy(), np.ones((128, 128), dtype=np.float32))[:m.shape[0], :m.shape[1]]
            f32[name] = data.float().numpy() * s_full         # float32 * float32 in numpy
    assert not all(ck._is_pow2(t) for n, t in tensors.items() if n.endswith("_scale_inv"))
    ref_gu = np.stack([np.concatenate([f32[f"{PREFIX}experts.{e}.gate_proj.weight"],
                                       f32[f"{PREFIX}experts.{e}.up_proj.weight"]]) for e in range(E)])
    ref_dn = np.stack([f32[f"{PREFIX}experts.{e}.down_proj.weight"] for e in range(E)])
    assert ref_gu.dtype == np.float32
    cfg = {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    d = _write(tmp_path / "ds", tensors, cfg)
    for source, config in ((d, None), (tensors, cfg), (tensors, None)):
        layer = MoKMoELayer(H, I, E, 2, dtype=dtype)
        ck.load_experts_into_layer(layer, source, prefix=PREFIX, config=config)
        assert torch.equal(layer.experts.gate_up_proj.detach(), torch.from_numpy(ref_gu).to(dtype))
        assert torch.equal(layer.experts.down_proj.detach(), torch.from_numpy(ref_dn).to(dtype))
        mx = MoKMoELayer(H, I, E, 2, dtype=dtype, precision="mxfp8")
        ck.load_experts_into_layer(mx, source, prefix=PREFIX, config=config)
        want = quantize(torch.from_numpy(ref_gu)).dequantize(dtype)
        assert torch.equal(mx.experts.gate_up_proj.detach(), want)
        assert not torch.equal(want, torch.from_numpy(ref_gu).to(dtype))
    raw = ck.load_mxfp8_tensors(d, dequantize_block=True)
    np.testing.assert_array_equal(raw[f"{PREFIX}experts.1.down_proj.weight"].numpy(),
                                  f32[f"{PREFIX}experts.1.down_proj.weight"])


def test_unquantized_and_quantize_expert_weights(tmp_path):
    gu, dn = _experts_fp32()
    tensors = {PREFIX + "experts.gate_up_proj": gu.bfloat16(), PREFIX + "experts.down_proj": dn.bfloat16(), **_extra()}
    assert ck.detect_format(tensors) == ck.FORMAT_UNQUANTIZED
    q = ck.quantize_expert_weights(tensors)
    assert isinstance(q[PREFIX + "experts.gate_up_proj"], MXFP8Tensor)
    assert torch.equal(q[PREFIX + "gate.weight"], tensors[PREFIX + "gate.weight"])  # router left alone
    path = tmp_path / "q.safetensors"
    ck.save_mxfp8(path, q)
    gu_q, dn_q = q[PREFIX + "experts.gate_up_proj"], q[PREFIX + "experts.down_proj"]
    _check_experts(ck.load_mxfp8_tensors(path), _np_dequant_mx(gu_q.data, gu_q.scale), _np_dequant_mx(dn_q.data, dn_q.scale))


# ----------------------------------------------------------------------------- errors


def test_errors_name_the_tensor(tmp_path):
    q = quantize(torch.randn(64, 64))
    w = "m.experts.0.gate_proj.weight"
    with pytest.raises(ck.CheckpointFormatError, match=w):
        ck.load_mxfp8_tensors({w: q.data})  # FP8 without scale
    with pytest.raises(ck.CheckpointFormatError, match=w + "_scale"):
        ck.load_mxfp8_tensors({w: q.data, w + "_scale": q.scale[:, :1]})  # wrong scale shape
    with pytest.raises(ck.CheckpointFormatError, match="orphan.weight_scale"):
        ck.load_mxfp8_tensors({w: q.data, w + "_scale": q.scale, "orphan.weight_scale": q.scale})
    with pytest.raises(ck.CheckpointFormatError, match=w + "_scale"):
        ck.load_mxfp8_tensors({w: q.data, w + "_scale": q.scale.float()}, CT_CONFIG)  # float scale in MX format
    s = torch.full((1, 1), 0.3)
    cfg = {"quantization_config": {"quant_method": "fp8", "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}}
    with pytest.raises(ck.CheckpointFormatError, match=w + "_scale_inv"):
        ck.load_mxfp8_tensors({w: q.data, w + "_scale_inv": s}, cfg)  # not a power of two
    with pytest.raises(ck.CheckpointFormatError, match=w + "_scale_inv"):
        ck.load_mxfp8_tensors({w: q.data, w + "_scale_inv": torch.ones(3, 3)}, cfg)  # inconsistent block shape
    with pytest.raises(ck.CheckpointFormatError, match="awq"):
        ck.detect_format({}, {"quantization_config": {"quant_method": "awq"}})
    with pytest.raises(ck.CheckpointFormatError, match="float-quantized"):
        ck.detect_format({}, {"quantization_config": {"quant_method": "compressed-tensors", "format": "float-quantized"}})
    with pytest.raises(ck.CheckpointFormatError, match="NVFP4"):
        ck.detect_format({}, {"quantization": {"quant_algo": "NVFP4"}})
    with pytest.raises(ck.CheckpointFormatError, match="experts.1.up_proj"):
        ck.expert_weights({"experts.0.gate_proj.weight": torch.ones(2, 32), "experts.0.up_proj.weight": torch.ones(2, 32),
                           "experts.0.down_proj.weight": torch.ones(32, 2), "experts.1.gate_proj.weight": torch.ones(2, 32)})
    bad_k = torch.zeros(64, 48, dtype=torch.float8_e4m3fn)
    with pytest.raises(ck.CheckpointFormatError, match="bad.weight"):
        ck.load_mxfp8_tensors({"bad.weight": bad_k, "bad.weight_scale_inv": torch.ones(1, 1)},
                              {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}})


@pytest.mark.parametrize("bad_dtype", [torch.float8_e5m2, torch.float32, torch.bfloat16])
def test_scaled_tensor_of_wrong_dtype_raises(tmp_path, bad_dtype):
    """A tensor with a scale partner must be quantised data of the format (float8_e4m3fn, or uint8 E4M3
    bytes in the MX formats): any other dtype raises naming the tensor and its dtype, whatever the format
    detected, instead of passing the raw values on with the scale dropped or ignored."""
    from mok_nn import MoKMoELayer

    gu, dn = _experts_fp32()
    qgu, qdn = quantize(gu), quantize(dn * 100)
    bad = qdn.data.to(bad_dtype)
    dn_name = PREFIX + "experts.down_proj"
    mixed = {PREFIX + "experts.gate_up_proj": qgu.data, PREFIX + "experts.gate_up_proj_scale": qgu.scale,
             dn_name: bad, dn_name + "_scale": qdn.scale}       # one good tensor: format "mxfp8"
    all_bad = {PREFIX + "experts.gate_up_proj": qgu.data.to(bad_dtype), PREFIX + "experts.gate_up_proj_scale":
               qgu.scale, dn_name: bad, dn_name + "_scale": qdn.scale}   # no e4m3 at all: "unquantized"
    dtype_re = str(bad_dtype).replace(".", r"\.")
    for tensors, config in ((mixed, None), (mixed, CT_CONFIG), (all_bad, None)):
        with pytest.raises(ck.CheckpointFormatError, match=rf"{dn_name}'.*{dtype_re}"):
            ck.load_mxfp8_tensors(tensors, config)
    layer = MoKMoELayer(H, I, E, 2, dtype=torch.float32)
    before = [p.detach().clone() for p in layer.experts.parameters()]
    with pytest.raises(ck.CheckpointFormatError, match=rf"{dn_name}'.*{dtype_re}"):
        ck.load_experts_into_layer(layer, mixed, prefix=PREFIX)
    assert all(torch.equal(p, b) for p, b in zip(layer.experts.parameters(), before))
    # the same from a file in our own format (metadata says mok_nn.mxfp8)
    d = _write(tmp_path / "mok", mixed, metadata={"format": "mok_nn.mxfp8"})
    with pytest.raises(ck.CheckpointFormatError, match=rf"{dn_name}'.*{dtype_re}"):
        ck.load_mxfp8_tensors(d)
    # ModelOpt config: uint8 data is accepted there, other dtypes are not
    mo_cfg = {"quantization_config": {"quant_method": "modelopt", "quant_algo": "MXFP8"}}
    mo = {PREFIX + "experts.w13_weight": qgu.data.view(torch.uint8), PREFIX + "experts.w13_weight_scale": qgu.scale,
          PREFIX + "experts.w2_weight": bad, PREFIX + "experts.w2_weight_scale": qdn.scale}
    with pytest.raises(ck.CheckpointFormatError, match=rf"w2_weight'.*{dtype_re}"):
        ck.load_mxfp8_tensors(mo, mo_cfg)
    # block FP8: the data of a _scale_inv must be float8_e4m3fn (uint8 included)
    bq, bs, _ = _block_fp8(dn, (128, 128), True, 9)
    for wrong in (bq.to(bad_dtype), bq.view(torch.uint8)):
        blk = {PREFIX + "experts.gate_up_proj": _block_fp8(gu, (128, 128), True, 10)[0],
               PREFIX + "experts.gate_up_proj_scale_inv": _block_fp8(gu, (128, 128), True, 10)[1],
               dn_name: wrong, dn_name + "_scale_inv": bs}
        with pytest.raises(ck.CheckpointFormatError, match=rf"{dn_name}'.*{re.escape(str(wrong.dtype))}"):
            ck.load_mxfp8_tensors(blk)
    with pytest.raises(ck.CheckpointFormatError, match=rf"{dn_name}'.*{dtype_re}"):
        ck.load_mxfp8_tensors({dn_name: bad, dn_name + "_scale_inv": bs})    # detected "unquantized"


def test_scale_of_uint8_data_is_never_dropped():
    """uint8 data whose scale is not E8M0 is not silently passed through raw with its scale dropped."""
    q = quantize(torch.randn(64, 64))
    w = "m.experts.0.gate_proj.weight"
    other = {"m.experts.0.up_proj.weight": q.data, "m.experts.0.up_proj.weight_scale": q.scale}
    with pytest.raises(ck.CheckpointFormatError, match=w + "_scale"):
        ck.load_mxfp8_tensors({**other, w: q.data.view(torch.uint8), w + "_scale": q.scale.float()})
    # a dict that already holds MXFP8Tensors is not re-read: raw data next to its scale there raises too
    loaded = {"experts.gate_up_proj": quantize(torch.randn(E, 2 * I, H)), "experts.down_proj": q.data,
              "experts.down_proj_scale": q.scale}
    from mok_nn import MoKMoELayer
    with pytest.raises(ck.CheckpointFormatError, match="experts.down_proj'"):
        ck.load_experts_into_layer(MoKMoELayer(H, I, E, 2, dtype=torch.float32), loaded)


def test_already_read_dict_is_accepted(tmp_path):
    """load_mxfp8_tensors / load_experts_into_layer take the dict load_mxfp8_tensors returned: same entries
    back (a new dict), the same layer weights as from the file; raw quantised data left in it still raises."""
    from mok_nn import MoKMoELayer

    gu, dn = _experts_fp32()
    qgu, qdn = quantize(gu), quantize(dn, axis=-2)
    path = tmp_path / "m.safetensors"
    ck.save_mxfp8(path, {PREFIX + "experts.gate_up_proj": qgu, PREFIX + "experts.down_proj": qdn, **_extra()})
    read = ck.load_mxfp8_tensors(path)
    again = ck.load_mxfp8_tensors(read)
    assert again is not read and set(again) == set(read)
    for name, t in read.items():
        assert again[name] is t
    np.testing.assert_array_equal(again[PREFIX + "experts.down_proj"].dequantize(torch.float64).numpy(),
                                  _np_dequant_mx(qdn.data, qdn.scale, axis=1))
    layer = MoKMoELayer(H, I, E, 2, dtype=torch.float32)
    ck.load_experts_into_layer(layer, read, prefix=PREFIX)
    np.testing.assert_array_equal(layer.experts.gate_up_proj.detach().double().numpy(),
                                  _np_dequant_mx(qgu.data, qgu.scale))
    for bad in ({"w": qgu.data}, {"w": qgu.data.float(), "w_scale_inv": torch.ones(1)}):
        with pytest.raises(ck.CheckpointFormatError, match="'w'"):
            ck.load_mxfp8_tensors({**read, **bad})


def test_example_script(tmp_path, capsys):
    import runpy
    import pathlib
    script = pathlib.Path(__file__).resolve().parents[1] / "examples" / "quantize_checkpoint.py"
    mod = runpy.run_path(str(script))
    src = tmp_path / "in.safetensors"
    mod["make_demo_checkpoint"](str(src), layers=1, experts=2, hidden=64, inter=32)
    out = tmp_path / "out.safetensors"
    mod["main"]([str(src), str(out)])
    assert "input format: unquantized" in capsys.readouterr().out
    loaded = ck.load_mxfp8_tensors(out)
    gu, dn = ck.expert_weights(loaded, "model.layers.0.mlp.")
    assert isinstance(gu, MXFP8Tensor) and gu.shape == (2, 64, 64) and dn.shape == (2, 64, 32)


def test_example_script_path_errors(tmp_path, capsys):
    """A missing input, an output inside the input directory or equal to the input file: an argparse
    error naming the path, nothing written; the directory still reads afterwards."""
    import runpy
    import pathlib
    script = pathlib.Path(__file__).resolve().parents[1] / "examples" / "quantize_checkpoint.py"
    mod = runpy.run_path(str(script))
    d = tmp_path / "ckpt"
    d.mkdir()
    mod["make_demo_checkpoint"](str(d / "model.safetensors"), layers=1, experts=2, hidden=64, inter=32)
    missing = tmp_path / "nope" / "in.safetensors"
    cases = (([str(missing), str(tmp_path / "o.safetensors")], str(missing)),
             ([str(d), str(d / "out.safetensors")], str(d / "out.safetensors")),
             ([str(d / "model.safetensors"), str(d / "model.safetensors")], str(d / "model.safetensors")),
             ([str(d), str(tmp_path / "no_dir" / "o.safetensors")], str(tmp_path / "no_dir" / "o.safetensors")))
    for argv, named in cases:
        before = sorted(p.name for p in d.iterdir())
        with pytest.raises(SystemExit) as info:
            mod["main"](argv)
        err = capsys.readouterr().err
        assert info.value.code == 2 and "error:" in err and repr(named) in err, (argv, err)
        assert sorted(p.name for p in d.iterdir()) == before and not (tmp_path / "o.safetensors").exists()
    out = tmp_path / "good.safetensors"
    mod["main"]([str(d), str(out)])
    assert set(ck.load_mxfp8_tensors(out)) == set(ck.load_mxfp8_tensors(d))
