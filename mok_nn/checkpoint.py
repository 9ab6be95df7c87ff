"""safetensors I/O for MXFP8 expert weights, and readers for the FP8 formats users have.

API::

    fmt = detect_format(path_or_tensors, config=None)        # one of FORMATS
    tensors = load_mxfp8_tensors(path_or_dir, config=None)    # {name: MXFP8Tensor | Tensor}
    load_mxfp8_tensors(tensors) == tensors                      # a read dict is accepted as is
    save_mxfp8(path, {name: MXFP8Tensor | Tensor}, metadata=None)
    quantize_expert_weights(tensors)                           # float expert weights -> MXFP8Tensor
    gate_up, down = expert_weights(tensors, prefix="model.layers.0.mlp.")  # [E,2I,H], [E,H,I]
    load_experts_into_layer(layer, path_or_tensors, prefix="model.layers.0.mlp.")  # MoKMoELayer
    load_experts_into_layer(layer, path_or_tensors, prefix, mxfp8_only=True)  # MXFP8-only (frozen) experts

``path_or_dir`` is one ``.safetensors`` file or a directory: all its
``*.safetensors`` shards are read, and its ``config.json`` /
``hf_quant_config.json`` supply ``config`` when none is given. ``config`` may
be a model config (with ``quantization_config``), a ``quantization_config``
itself, or ModelOpt's ``hf_quant_config.json`` content. Everything is read
into CPU memory at once.

Loaded names: a quantised tensor ``X`` and its scale ``X_scale`` /
``X_scale_inv`` become one entry ``X`` holding an ``MXFP8Tensor``; every other
tensor is passed through unchanged. Formats (``detect_format`` results):

- ``"mok_nn.mxfp8"`` (ours, written by ``save_mxfp8``): ``X`` float8_e4m3fn and
  ``X_scale`` uint8 E8M0, e.g. ``<prefix>.experts.gate_up_proj`` [E, 2I, H] and
  ``<prefix>.experts.gate_up_proj_scale`` [E, 2I, H/32]; safetensors metadata
  ``{"format": "mok_nn.mxfp8", "mxfp8": json {X: {"axis", "block_size"}}}``
  plus the caller's string metadata. Column-wise tensors round-trip too.
- ``"compressed-tensors-mxfp8"``: ``quantization_config.quant_method ==
  "compressed-tensors"`` with format ``"mxfp8-quantized"``; ``<module>.weight``
  float8_e4m3fn [N, K] + ``<module>.weight_scale`` uint8 [N, K/32].
- ``"modelopt-mxfp8"``: ``quant_algo == "MXFP8"`` (``hf_quant_config.json`` or
  ``quantization_config``); per-module ``weight`` / ``weight_scale`` or fused
  MoE ``w13_weight`` [E, 2I, H] / ``w13_weight_scale`` [E, 2I, H/32] and
  ``w2_weight`` [E, H, I] / ``w2_weight_scale``. FP8 data stored as uint8 is
  accepted.
- ``"mxfp8"``: the same tensor layout without a config that names it.
- ``"fp8-block-ue8m0"``: transformers 5.x fine-grained FP8 with
  ``scale_fmt: "ue8m0"``: ``X`` float8_e4m3fn + ``X_scale_inv`` (float32 powers
  of two, or uint8 / float8_e8m0fnu E8M0) per ``weight_block_size`` block, e.g.
  fused ``experts.gate_up_proj`` + ``experts.gate_up_proj_scale_inv``.
  Converted by dequantise + requantise ("rceil"), which is lossless for
  power-of-two block scales (checked).
- ``"fp8-block"``: DeepSeek-V3 block FP8 (``quant_method: "fp8"``): ``weight``
  float8_e4m3fn + ``weight_scale_inv`` float32 [ceil(N/128), ceil(K/128)]
  (``weight_block_size``, default [128, 128]); the value is ``fp8 *
  scale_inv``. Converted by dequantise (fp32) + requantise to MXFP8 along K;
  ``load_mxfp8_tensors(..., dequantize_block=True)`` (used by
  ``load_experts_into_layer`` for a ``precision="bf16"`` layer) keeps the fp32
  values instead.
- ``"unquantized"``: no FP8 tensors; everything is passed through.

Without a config the format comes from the tensors: ``*_scale_inv`` ->
``fp8-block-ue8m0`` when all block scales are powers of two, else
``fp8-block``; uint8 ``*_scale`` next to FP8 data -> ``mxfp8``. An FP8 tensor
without a scale, a scale without data, a scale of the wrong dtype or shape, or
an unsupported quantisation config raises ``CheckpointFormatError`` naming the
tensor (or the config entry). So does a tensor ``X`` next to a scale
``X_scale`` / ``X_scale_inv`` that is not quantised data of the format
(float8_e4m3fn; uint8 E4M3 bytes in the MX formats), e.g. float8_e5m2, bf16
or fp32 values: such a scale is never dropped or passed on unused.
"""

from __future__ import annotations

import json
import os
import re
from typing import Mapping

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .mxfp8 import E8M0_BIAS, MXFP8Tensor, quantize

FORMAT_MOK = "mok_nn.mxfp8"
FORMAT_COMPRESSED_TENSORS = "compressed-tensors-mxfp8"
FORMAT_MODELOPT = "modelopt-mxfp8"
FORMAT_MXFP8 = "mxfp8"
FORMAT_FP8_UE8M0 = "fp8-block-ue8m0"
FORMAT_FP8_BLOCK = "fp8-block"
FORMAT_UNQUANTIZED = "unquantized"
FORMATS = (FORMAT_MOK, FORMAT_COMPRESSED_TENSORS, FORMAT_MODELOPT, FORMAT_MXFP8,
           FORMAT_FP8_UE8M0, FORMAT_FP8_BLOCK, FORMAT_UNQUANTIZED)
_MX_FORMATS = (FORMAT_MOK, FORMAT_COMPRESSED_TENSORS, FORMAT_MODELOPT, FORMAT_MXFP8)
_BLOCK_FORMATS = (FORMAT_FP8_UE8M0, FORMAT_FP8_BLOCK)

_FP8 = torch.float8_e4m3fn
_E8M0_DTYPES = (torch.uint8, torch.float8_e8m0fnu)


class CheckpointFormatError(ValueError):
    """The checkpoint is of an unknown format or inconsistent with its format."""


# ----------------------------------------------------------------------------- reading


def read_safetensors(path_or_dir) -> tuple[dict, dict, dict | None]:
    """(tensors, safetensors metadata, config or None) of a file or a directory of shards.

    The shards' metadata is merged, except the per-tensor MXFP8 layouts (entry ``"mxfp8"``, a JSON
    object written by save_mxfp8 in a ``mok_nn.mxfp8`` file), which are merged per tensor; shards that give one tensor
    different layouts raise CheckpointFormatError."""
    path = os.fspath(path_or_dir)
    if os.path.isdir(path):
        files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
        if not files:
            raise FileNotFoundError(f"no .safetensors files in {path}")
        config = None
        for cfg_name in ("hf_quant_config.json", "config.json"):
            cfg_path = os.path.join(path, cfg_name)
            if config is None and os.path.exists(cfg_path):
                with open(cfg_path) as f:
                    config = json.load(f)
                if cfg_name == "config.json" and "quantization_config" not in config:
                    config = None
    else:
        files, config = [path], None
    tensors, metadata, layout, layout_from = {}, {}, {}, {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            file_meta = dict(f.metadata() or {})
            text = file_meta.pop("mxfp8", None) if file_meta.get("format") == FORMAT_MOK else None
            for name, info in _layout_of(file, text).items():
                if name in layout and layout[name] != info:
                    raise CheckpointFormatError(
                        f"shards {layout_from[name]} and {file} disagree about the MXFP8 layout of tensor "
                        f"{name!r}: {layout[name]} vs {info}")
                layout[name], layout_from[name] = info, file
            metadata.update(file_meta)
            for name in f.keys():
                if name in tensors:
                    raise CheckpointFormatError(f"tensor {name!r} appears in more than one shard ({file})")
                tensors[name] = f.get_tensor(name)
    if layout_from:
        metadata["mxfp8"] = json.dumps(layout, sort_keys=True)
    return tensors, metadata, config


def _layout_of(file: str, text) -> dict:
    """The per-tensor MXFP8 layout ``{name: {"axis", "block_size"}}`` of save_mxfp8's metadata entry."""
    if text is None:
        return {}
    try:
        layout = json.loads(text)
    except ValueError:
        layout = None
    if not isinstance(layout, dict) or not all(isinstance(v, dict) for v in layout.values()):
        raise CheckpointFormatError(f"metadata entry 'mxfp8' of {file} is not a JSON object of per-tensor layouts")
    return layout


def quantization_config(config) -> dict | None:
    """The quantisation part of a model config, quantization_config or hf_quant_config.json."""
    if not config:
        return None
    if "quantization_config" in config:
        return config["quantization_config"]
    if "quantization" in config and isinstance(config["quantization"], Mapping):  # ModelOpt
        return {"quant_method": "modelopt", **config["quantization"]}
    return config


def _format_from_config(qc: Mapping) -> str:
    method = str(qc.get("quant_method", "")).lower()
    if method == "compressed-tensors":
        fmts = {qc.get("format")} | {g.get("format") for g in qc.get("config_groups", {}).values()}
        fmts.discard(None)
        if fmts != {"mxfp8-quantized"}:
            raise CheckpointFormatError(
                f"quantization_config.format {sorted(fmts)} is not supported (only 'mxfp8-quantized')")
        return FORMAT_COMPRESSED_TENSORS
    if method == "modelopt" or "quant_algo" in qc:
        algo = str(qc.get("quant_algo", "")).upper()
        if algo != "MXFP8":
            raise CheckpointFormatError(f"quant_algo {qc.get('quant_algo')!r} is not supported (only 'MXFP8')")
        return FORMAT_MODELOPT
    if method == "fp8":
        return FORMAT_FP8_UE8M0 if qc.get("scale_fmt") == "ue8m0" else FORMAT_FP8_BLOCK
    raise CheckpointFormatError(f"quantization_config.quant_method {qc.get('quant_method')!r} is not supported")


def _is_pow2(s: torch.Tensor) -> bool:
    s = s.double()
    m, _ = torch.frexp(s)
    return bool(((m == 0.5) & (s >= 2.0**-E8M0_BIAS) & (s <= 2.0**E8M0_BIAS)).all())


def _data_names(tensors: Mapping) -> list[str]:
    """FP8 tensors, and uint8 tensors with a uint8 `_scale` partner (ModelOpt stores FP8 as uint8)."""
    out = []
    for name, t in tensors.items():
        partner = tensors.get(name + "_scale")
        if t.dtype == _FP8 or (t.dtype == torch.uint8 and partner is not None and partner.dtype in _E8M0_DTYPES):
            out.append(name)
    return out


def _format_from_tensors(tensors: Mapping) -> str:
    names = _data_names(tensors)
    if not names:
        return FORMAT_UNQUANTIZED
    first = names[0]
    if first + "_scale_inv" in tensors:
        inv = [tensors[n + "_scale_inv"] for n in names if n + "_scale_inv" in tensors]
        if all(s.dtype in _E8M0_DTYPES or _is_pow2(s) for s in inv):
            return FORMAT_FP8_UE8M0
        return FORMAT_FP8_BLOCK
    if first + "_scale" in tensors:
        return FORMAT_MXFP8
    raise CheckpointFormatError(f"FP8 tensor {first!r} has no {first + '_scale'!r} or {first + '_scale_inv'!r}")


def detect_format(tensors_or_path, config=None, metadata=None) -> str:
    """The checkpoint format (one of FORMATS), from metadata, then config, then tensor names."""
    if not isinstance(tensors_or_path, Mapping):
        tensors, file_meta, file_config = read_safetensors(tensors_or_path)
        metadata = metadata or file_meta
        config = config if config is not None else file_config
    else:
        tensors = tensors_or_path
    if metadata and metadata.get("format") == FORMAT_MOK:
        return FORMAT_MOK
    qc = quantization_config(config)
    if qc:
        return _format_from_config(qc)
    return _format_from_tensors(tensors)


_SCALE_SUFFIXES = ("_scale", "_scale_inv")


def _scales_next_to(name: str, tensors: Mapping) -> list:
    """The scale tensors ``name_scale`` / ``name_scale_inv`` present beside ``name``."""
    return [name + s for s in _SCALE_SUFFIXES if name + s in tensors]


def _check_scaled_data(tensors: Mapping, fmt: str) -> None:
    """Every tensor ``X`` next to a scale ``X_scale`` / ``X_scale_inv`` must be quantised data of ``fmt``
    (float8_e4m3fn; uint8 E4M3 bytes in the MX formats): raw values next to a scale would otherwise be
    loaded as they are, their scale dropped or passed on unused."""
    allowed = (_FP8, torch.uint8) if fmt in _MX_FORMATS else (_FP8,)
    bad = []
    for name, t in tensors.items():
        scales = _scales_next_to(name, tensors)
        if scales and (fmt == FORMAT_UNQUANTIZED or t.dtype not in allowed):
            bad.append(f"tensor {name!r} has dtype {t.dtype} next to its scale {scales[0]!r}")
    if not bad:
        return
    if fmt == FORMAT_UNQUANTIZED:
        why = ("quantised data (float8_e4m3fn, or uint8 E4M3 bytes with a uint8 E8M0 scale); "
               "the checkpoint has none, so it reads as unquantized")
    else:
        want = "float8_e4m3fn, or uint8 holding E4M3 bytes" if fmt in _MX_FORMATS else "float8_e4m3fn"
        why = f"the quantised data of the {fmt} format ({want})"
    raise CheckpointFormatError("; ".join(bad) + f": a tensor with a scale must hold {why}")


# ----------------------------------------------------------------------------- conversion


def _as_e8m0(name: str, s: torch.Tensor) -> torch.Tensor:
    if s.dtype not in _E8M0_DTYPES:
        raise CheckpointFormatError(f"scale tensor {name!r} has dtype {s.dtype}, expected uint8 (E8M0)")
    return s.view(torch.uint8)


def _mx_tensor(name: str, data: torch.Tensor, scale: torch.Tensor, axis: int, block_size: int) -> MXFP8Tensor:
    if data.dtype == torch.uint8:
        data = data.view(_FP8)
    axis = axis % data.dim()
    expected = list(data.shape)
    if data.shape[axis] % block_size:
        raise CheckpointFormatError(
            f"tensor {name!r} of shape {tuple(data.shape)}: size {data.shape[axis]} along axis {axis} "
            f"is not a multiple of the block size {block_size}")
    expected[axis] //= block_size
    if list(scale.shape) != expected:
        raise CheckpointFormatError(
            f"scale tensor {name + '_scale'!r} has shape {tuple(scale.shape)}, expected {tuple(expected)} "
            f"for {name!r} of shape {tuple(data.shape)} (block size {block_size} along axis {axis})")
    return MXFP8Tensor(data.contiguous(), scale.contiguous(), axis, block_size)


def _block_size_from_config(qc: Mapping | None) -> int:
    if not qc:
        return 32
    for group in qc.get("config_groups", {}).values():  # compressed-tensors
        gs = (group.get("weights") or {}).get("group_size")
        if gs is not None:
            return int(gs)
    return int(qc.get("group_size", 32))


def _load_mx(tensors: Mapping, fmt: str, metadata: Mapping, qc) -> dict:
    layout = json.loads(metadata.get("mxfp8", "{}")) if fmt == FORMAT_MOK else {}
    default_bs = _block_size_from_config(qc)
    # FP8 data, and every tensor with a `_scale` (its dtype checked by _check_scaled_data)
    names = [n for n, t in tensors.items() if t.dtype == _FP8 or n + "_scale" in tensors]
    out, used = {}, set()
    for name in names:
        if name + "_scale" not in tensors:
            raise CheckpointFormatError(f"FP8 tensor {name!r} has no scale tensor {name + '_scale'!r}")
        info = layout.get(name, {})
        scale = _as_e8m0(name + "_scale", tensors[name + "_scale"])
        out[name] = _mx_tensor(name, tensors[name], scale, info.get("axis", -1), info.get("block_size", default_bs))
        used.update((name, name + "_scale"))
    for name, t in tensors.items():
        if name in used:
            continue
        if name.endswith("_scale") and t.dtype in _E8M0_DTYPES:
            raise CheckpointFormatError(f"scale tensor {name!r} has no FP8 data tensor {name[:-len('_scale')]!r}")
        if name.endswith("_scale_inv"):
            raise CheckpointFormatError(f"tensor {name!r} is a block-FP8 scale in an {fmt} checkpoint")
        out[name] = t
    return out


def block_fp8_block_size(name: str, data_shape, scale_shape, configured=None) -> tuple[int, int]:
    """(rows, cols) of the block-FP8 tiles of `name`: the configured ones, or inferred from the shapes."""
    n, k = data_shape[-2], data_shape[-1]
    candidates = [tuple(configured)] if configured else [(128, 128), (1, 32), (1, 128)]
    for bn, bk in candidates:
        if tuple(scale_shape[-2:]) == (-(-n // bn), -(-k // bk)) and tuple(scale_shape[:-2]) == tuple(data_shape[:-2]):
            return bn, bk
    raise CheckpointFormatError(
        f"scale tensor {name + '_scale_inv'!r} has shape {tuple(scale_shape)}, which does not match "
        f"{name!r} of shape {tuple(data_shape)} with block size {candidates if not configured else configured}")


def dequantize_block_fp8(data: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """fp32 ``data * scale_inv`` with one scale per ``block`` = (rows, cols) tile of the last two dims."""
    n, k = data.shape[-2], data.shape[-1]
    s = scale_inv.float().repeat_interleave(block[0], dim=-2).repeat_interleave(block[1], dim=-1)
    return data.float() * s[..., :n, :k]


def _load_block(tensors: Mapping, fmt: str, qc, scale_mode: str, dequantize_block: bool = False) -> dict:
    configured = (qc or {}).get("weight_block_size")
    out, used = {}, set()
    for name in [n for n, t in tensors.items() if t.dtype == _FP8 or n + "_scale_inv" in tensors]:
        sname = name + "_scale_inv"
        if sname not in tensors:
            raise CheckpointFormatError(f"FP8 tensor {name!r} has no scale tensor {sname!r}")
        s = tensors[sname]
        if s.dtype in _E8M0_DTYPES:  # E8M0 bits stored directly
            s = torch.exp2(s.view(torch.uint8).double() - E8M0_BIAS)
        elif not s.is_floating_point():
            raise CheckpointFormatError(f"scale tensor {sname!r} has dtype {s.dtype}, expected a float or E8M0")
        if fmt == FORMAT_FP8_UE8M0 and not _is_pow2(s):
            raise CheckpointFormatError(f"scale tensor {sname!r} is not a power of two everywhere (ue8m0 expected)")
        block = block_fp8_block_size(name, tensors[name].shape, s.shape, configured)
        w = dequantize_block_fp8(tensors[name], s, block)
        used.update((name, sname))
        if dequantize_block:
            out[name] = w
            continue
        try:
            q = quantize(w, axis=-1, scale_mode=scale_mode)
        except ValueError as err:
            raise CheckpointFormatError(f"tensor {name!r}: {err}") from None
        if fmt == FORMAT_FP8_UE8M0 and not torch.equal(q.dequantize(torch.float32), w):
            raise CheckpointFormatError(f"tensor {name!r}: ue8m0 block FP8 did not convert losslessly to MXFP8")
        out[name] = q
    for name, t in tensors.items():
        if name in used:
            continue
        if name.endswith("_scale_inv"):
            raise CheckpointFormatError(f"scale tensor {name!r} has no FP8 data tensor {name[:-len('_scale_inv')]!r}")
        out[name] = t
    return out


def _is_already_read(tensors) -> bool:
    """Whether ``tensors`` is a dict already read by ``load_mxfp8_tensors`` (it holds MXFP8Tensors)."""
    return isinstance(tensors, Mapping) and any(isinstance(t, MXFP8Tensor) for t in tensors.values())


def _check_already_read(tensors: Mapping) -> None:
    """A dict of MXFP8Tensors is not re-read: quantised data left in it raw would be used as values."""
    for name, t in tensors.items():
        if not isinstance(t, (torch.Tensor, MXFP8Tensor)):
            raise CheckpointFormatError(f"tensor {name!r} is a {type(t).__name__}, expected MXFP8Tensor or Tensor")
        if isinstance(t, MXFP8Tensor):
            continue
        scales = _scales_next_to(name, tensors)
        if scales or t.dtype == _FP8:
            why = f"sits next to its scale tensor {scales[0]!r}" if scales else "is FP8 data without a scale"
            raise CheckpointFormatError(
                f"tensor {name!r} (dtype {t.dtype}) {why} in a dict of MXFP8Tensors: read the raw "
                "checkpoint with load_mxfp8_tensors, or give an MXFP8Tensor")


def load_mxfp8_tensors(path_or_dir, config=None, scale_mode: str = "rceil", *,
                       dequantize_block: bool = False) -> dict:
    """Read a checkpoint of any supported format; quantised tensors come back as MXFP8Tensor.

    ``path_or_dir`` may also be an already-read ``{name: Tensor}`` dict (raw checkpoint tensors),
    or a dict this function returned (it holds MXFP8Tensors): that one is returned as a new dict
    with the same entries, after checking that no raw quantised data is left in it (FP8 data, or
    a tensor next to a ``_scale`` / ``_scale_inv``); ``config`` and ``scale_mode`` are not used then.
    ``scale_mode`` is used where block FP8 is requantised. With ``dequantize_block=True``, block-FP8
    tensors (formats fp8-block, fp8-block-ue8m0) are not requantised: they come back as float32 Tensors
    holding ``fp8 * scale_inv`` computed in fp32 (``dequantize_block_fp8``); the MX formats are unaffected.
    """
    if _is_already_read(path_or_dir):
        _check_already_read(path_or_dir)
        return dict(path_or_dir)
    if isinstance(path_or_dir, Mapping):
        tensors, metadata = dict(path_or_dir), {}
    else:
        tensors, metadata, file_config = read_safetensors(path_or_dir)
        config = config if config is not None else file_config
    fmt = detect_format(tensors, config, metadata)
    _check_scaled_data(tensors, fmt)
    qc = quantization_config(config)
    if fmt in _MX_FORMATS:
        return _load_mx(tensors, fmt, metadata, qc)
    if fmt in _BLOCK_FORMATS:
        return _load_block(tensors, fmt, qc, scale_mode, dequantize_block)
    return dict(tensors)


# ----------------------------------------------------------------------------- writing


def save_mxfp8(path, tensors: Mapping, metadata: Mapping | None = None) -> None:
    """Write ``{name: MXFP8Tensor | Tensor}`` in the ``mok_nn.mxfp8`` safetensors format."""
    metadata = dict(metadata or {})
    for key in ("format", "mxfp8"):
        if key in metadata:
            raise ValueError(f"metadata key {key!r} is reserved by save_mxfp8")
    out, layout = {}, {}
    for name, t in tensors.items():
        if isinstance(t, MXFP8Tensor):
            for key in (name, name + "_scale"):
                if key in out or key in tensors and key != name:
                    raise ValueError(f"tensor name {key!r} is used twice")
            out[name] = t.data.detach().cpu().contiguous()
            out[name + "_scale"] = t.scale.detach().cpu().contiguous()
            layout[name] = {"axis": t.axis, "block_size": t.block_size}
        elif isinstance(t, torch.Tensor):
            if name in out:
                raise ValueError(f"tensor name {name!r} is used twice")
            out[name] = t.detach().cpu().contiguous()
        else:
            raise TypeError(f"tensor {name!r} is a {type(t).__name__}, expected MXFP8Tensor or Tensor")
    metadata = {str(k): str(v) for k, v in metadata.items()}
    metadata.update({"format": FORMAT_MOK, "mxfp8": json.dumps(layout, sort_keys=True)})
    save_file(out, os.fspath(path), metadata=metadata)


# ----------------------------------------------------------------------------- expert weights

_EXPERT_SUFFIXES = ("experts.gate_up_proj", "experts.down_proj", "w13_weight", "w2_weight")
_PER_EXPERT = re.compile(r"experts\.\d+\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")


def is_expert_weight(name: str) -> bool:
    """Whether ``name`` is an expert projection weight in one of the known naming schemes."""
    return name.endswith(_EXPERT_SUFFIXES) or bool(_PER_EXPERT.search(name))


def quantize_expert_weights(tensors: Mapping, scale_mode: str = "rceil", block_size: int = 32) -> dict:
    """Quantise the floating-point expert weights (row-wise, along K) and pass everything else through."""
    out = {}
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != _FP8 and is_expert_weight(name):
            try:
                out[name] = quantize(t, axis=-1, block_size=block_size, scale_mode=scale_mode)
            except (ValueError, TypeError) as err:
                raise ValueError(f"tensor {name!r}: {err}") from None
        else:
            out[name] = t
    return out


def _stack(parts: list, dim: int):
    """torch.cat for Tensors or row-wise MXFP8Tensors (dim must not be the block axis)."""
    if all(isinstance(p, torch.Tensor) for p in parts):
        return torch.cat(parts, dim)
    if not all(isinstance(p, MXFP8Tensor) for p in parts):
        raise CheckpointFormatError("expert weights mix MXFP8 and unquantised tensors")
    axis, bs, nd = parts[0].axis, parts[0].block_size, parts[0].data.dim()
    if any(p.axis != axis or p.block_size != bs for p in parts) or axis == dim % nd:
        raise CheckpointFormatError("expert weights have different or incompatible MXFP8 layouts")
    return MXFP8Tensor(torch.cat([p.data for p in parts], dim), torch.cat([p.scale for p in parts], dim), axis, bs)


def _unsqueeze0(t):
    if isinstance(t, MXFP8Tensor):
        return MXFP8Tensor(t.data.unsqueeze(0), t.scale.unsqueeze(0), t.axis + 1, t.block_size)
    return t.unsqueeze(0)


def expert_weights(tensors: Mapping, prefix: str = ""):
    """``(gate_up_proj [E, 2I, H], down_proj [E, H, I])`` of one MoE block, each MXFP8Tensor or Tensor.

    ``prefix`` is the MoE block's name with a trailing dot (e.g. ``"model.layers.3.mlp."``).
    Naming schemes: fused ``experts.gate_up_proj`` / ``experts.down_proj`` (mok_nn, transformers
    5.x), ``[experts.]w13_weight`` / ``[experts.]w2_weight`` (ModelOpt / vLLM), and per-expert
    ``experts.<e>.{gate,up,down}_proj.weight`` or ``experts.<e>.{w1,w3,w2}.weight`` (Mixtral).
    Gate rows come first in gate_up_proj.
    """
    for gu, dn in (("experts.gate_up_proj", "experts.down_proj"), ("w13_weight", "w2_weight"),
                   ("experts.w13_weight", "experts.w2_weight")):
        if prefix + gu in tensors:
            if prefix + dn not in tensors:
                raise CheckpointFormatError(f"tensor {prefix + dn!r} is missing (found {prefix + gu!r})")
            return tensors[prefix + gu], tensors[prefix + dn]
    pattern = re.compile(re.escape(prefix) + r"experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")
    found: dict[int, dict] = {}
    for name in tensors:
        m = pattern.match(name)
        if m:
            role = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}.get(m.group(2), m.group(2))
            found.setdefault(int(m.group(1)), {})[role] = tensors[name]
    if not found:
        raise CheckpointFormatError(f"no expert weights under prefix {prefix!r}")
    gate_up, down = [], []
    for e in range(max(found) + 1):
        roles = found.get(e, {})
        for role in ("gate_proj", "up_proj", "down_proj"):
            if role not in roles:
                raise CheckpointFormatError(f"tensor {prefix}experts.{e}.{role}.weight is missing")
        gate_up.append(_unsqueeze0(_stack([roles["gate_proj"], roles["up_proj"]], 0)))
        down.append(_unsqueeze0(roles["down_proj"]))
    return _stack(gate_up, 0), _stack(down, 0)


def _slice0(t, start: int, stop: int):
    if isinstance(t, MXFP8Tensor):
        return MXFP8Tensor(t.data[start:stop], t.scale[start:stop], t.axis, t.block_size)
    return t[start:stop]


def _values(t, dtype):
    return t.dequantize(dtype) if isinstance(t, MXFP8Tensor) else t.to(dtype)


def _mx_rows(name: str, t, start: int, stop: int, scale_mode: str) -> MXFP8Tensor:
    """Experts [start, stop) of a checkpoint's expert weight as MXFP8 along K in blocks of 32 (what an MXFP8-only
    layer holds): the stored bits where they are that already; else quantised once here, expert by expert
    ("rceil"): float weights of an unquantised checkpoint, and MXFP8 of another layout (column-wise, other block
    sizes: their fp32 values requantised)."""
    t = _slice0(t, start, stop)
    if isinstance(t, MXFP8Tensor) and t.axis == t.data.dim() - 1 and t.block_size == 32:
        return t
    data, scales = [], []
    for e in range(t.shape[0]):
        if isinstance(t, MXFP8Tensor):
            w = _slice0(t, e, e + 1).dequantize(torch.float32)[0]
        else:
            w = t[e] if t.dtype in (torch.float32, torch.bfloat16, torch.float16) else t[e].float()
        try:
            q = quantize(w, axis=-1, block_size=32, scale_mode=scale_mode)
        except (ValueError, TypeError) as err:
            raise CheckpointFormatError(f"expert weight {name}: {err}") from None
        data.append(q.data)
        scales.append(q.scale)
    return MXFP8Tensor(torch.stack(data), torch.stack(scales), 2, 32)


@torch.no_grad()
def load_experts_into_layer(layer, tensors_or_path, prefix: str = "", config=None, *,
                            mxfp8_only: bool | None = None) -> None:
    """Fill ``layer.experts`` (a MoKMoELayer) from a checkpoint of any supported format.

    ``tensors_or_path``: a path / directory, a raw ``{name: Tensor}`` dict, or the result of
    ``load_mxfp8_tensors``. The expert weights of the block under ``prefix`` (see
    ``expert_weights``) are dequantised into the layer's parameters; with ``ep_group`` of size P,
    rank r takes experts [r*E/P, (r+1)*E/P). Biases ``<prefix>experts.gate_up_proj_bias`` /
    ``down_proj_bias`` are copied; the checkpoint must have them exactly when the layer does.

    Values written: MXFP8 weights (the MX formats) are dequantised, which is exact in bf16 / fp32,
    and MXFP8 requantisation of them ("rceil") gives back the same values, so a ``precision="mxfp8"``
    layer computes its forward on exactly the checkpoint's weights. Block-FP8 weights (fp8-block,
    fp8-block-ue8m0) read from a path or a raw dict go into a ``precision="bf16"`` layer as
    ``fp8 * scale_inv`` computed in fp32 and cast once to the layer dtype (no MXFP8 step); into a
    ``precision="mxfp8"`` layer they are first requantised to MXFP8 along K ("rceil", which is
    lossless for power-of-two scales; DeepSeek-V3's non-power-of-two scales lose up to one E4M3
    rounding, ~2**-4 relative), so that the layer holds values its MXFP8 forward keeps unchanged.
    A dict returned by ``load_mxfp8_tensors`` holds block FP8 already requantised to MXFP8.

    MXFP8-only layers (``layer.experts.mxfp8_only``, or ``mxfp8_only=True``, which makes the layer's expert
    weights MXFP8-only first, dropping its parameters without converting them): the expert weights are written
    as MXFP8 bits into the layer's buffers, never as values in the layer dtype. MXFP8 weights stored along K in
    blocks of 32 (every MX format as written, fp8-block-ue8m0, which converts losslessly) are copied bit for bit;
    block FP8 with non-power-of-two scales (fp8-block) is requantised to MXFP8 along K ("rceil") once here, as
    for a ``precision="mxfp8"`` layer (one E4M3 rounding); float weights (unquantized) and MXFP8 of another
    layout are quantised along K ("rceil") here, one expert at a time. ``mxfp8_only=False`` turns an MXFP8-only
    layer's weights back into parameters and fills them as above.
    """
    experts = layer.experts
    if mxfp8_only is None:
        mxfp8_only = bool(getattr(experts, "mxfp8_only", False))
    direct = getattr(layer, "precision", "bf16") != "mxfp8" and not mxfp8_only
    # an already-read dict: checked, used as is
    tensors = load_mxfp8_tensors(tensors_or_path, config, dequantize_block=direct)
    gu, dn = expert_weights(tensors, prefix)
    e_total, e_local = layer.num_experts, layer.num_local_experts
    want_gu = (e_total, 2 * layer.intermediate_size, layer.hidden_size)
    want_dn = (e_total, layer.hidden_size, layer.intermediate_size)
    for name, t, want in (("gate_up_proj", gu, want_gu), ("down_proj", dn, want_dn)):
        if tuple(t.shape) != want:
            raise CheckpointFormatError(
                f"expert weight {prefix}experts.{name} has shape {tuple(t.shape)}, the layer needs {want}")
    bias_names = ("gate_up_proj_bias", "down_proj_bias")
    dropped = [f"{prefix}experts.{n}" for n in bias_names
               if getattr(experts, n) is None and f"{prefix}experts.{n}" in tensors]
    absent = [f"{prefix}experts.{n}" for n in bias_names
              if getattr(experts, n) is not None and f"{prefix}experts.{n}" not in tensors]
    if dropped:
        raise CheckpointFormatError(f"the checkpoint has expert biases {dropped} but the layer has none "
                                    "(build it with expert_proj_bias=True)")
    if absent:
        raise CheckpointFormatError(f"the layer has expert biases but the checkpoint lacks {absent}")
    start, stop = layer.ep_rank * e_local, (layer.ep_rank + 1) * e_local
    if mxfp8_only:
        experts.set_mxfp8_(_mx_rows(f"{prefix}experts.gate_up_proj", gu, start, stop, "rceil"),
                           _mx_rows(f"{prefix}experts.down_proj", dn, start, stop, "rceil"))
    else:
        if getattr(experts, "mxfp8_only", False):
            experts._set_storage(False, experts.gate_up_proj.device)
        experts.gate_up_proj.copy_(_values(_slice0(gu, start, stop), experts.gate_up_proj.dtype))
        experts.down_proj.copy_(_values(_slice0(dn, start, stop), experts.down_proj.dtype))
    for name in bias_names:
        param = getattr(experts, name)
        if param is not None:
            param.copy_(_values(_slice0(tensors[f"{prefix}experts.{name}"], start, stop), param.dtype))
