"""precision="mxfp8": the reference path against an independent float64 model, and checkpoint loading."""

import pytest
import torch

from mok_nn import MoKMoELayer, checkpoint, reference
from mok_nn.mxfp8 import fake_quantize, fake_quantize_padded, quantize

T, H, I, E, K = 112, 64, 32, 4, 2


def fq(a: torch.Tensor, axis: int) -> torch.Tensor:
    """MXFP8 value of a float64 operand (rounded to fp32 first, as the fp32 reference holds it)."""
    return fake_quantize_padded(a.float(), axis).double()


def ident(a, axis):
    return a


def act(gu, activation, limit):
    g, u = gu.chunk(2, dim=-1)
    if limit is not None:
        g, u = g.clamp(max=limit), u.clamp(-limit, limit)
    if activation == "swiglu":
        return g * torch.sigmoid(g) * u
    return (u + 1) * g * torch.sigmoid(1.702 * g)


def model(x, ids, w, p, dy, activation, limit, q=fq, q_w_bwd_axis=0, token_perm=None):
    """The MXFP8 expert computation written per expert in float64 (docs/mxfp8.md).

    Returns y and the gradients of sum(y * dy) (x, topk weights, W13, W2, b13, b2).
    token_perm (tests only) reorders each expert's rows before the weight-gradient GEMMs.
    """
    x, w, dy = x.double(), w.double(), dy.double()
    w13, w2, b13, b2 = (t.double() for t in p)
    y = torch.zeros(T, H, dtype=torch.float64)
    dx, dw = torch.zeros_like(y), torch.zeros(T, K, dtype=torch.float64)
    dw13, dw2, db13, db2 = (torch.zeros_like(t) for t in (w13, w2, b13, b2))
    for e in range(E):
        tok, j = (ids == e).nonzero(as_tuple=True)  # ascending token order: the expert's rows
        if tok.numel() == 0:
            continue
        perm = torch.arange(tok.numel()) if token_perm is None else token_perm(tok.numel())
        X, we, dY = x[tok], w[tok, j].unsqueeze(1), dy[tok]
        gu = (q(X, 1) @ q(w13[e], 1).T + b13[e]).requires_grad_(True)
        h = act(gu, activation, limit)
        out = q(h.detach(), 1) @ q(w2[e], 1).T + b2[e]
        y.index_put_((tok,), we * out, accumulate=True)  # one row per token per expert: no collisions
        dh = q(dY, 1) @ q(w2[e], q_w_bwd_axis)
        dw[tok, j] = (dh * h.detach()).sum(1) + dY @ b2[e]
        db2[e] = (we * dY).sum(0)
        dw2[e] = q(dY[perm], 0).T @ q((we * h.detach())[perm], 0)
        (dgu,) = torch.autograd.grad(h, gu, we * dh)
        dw13[e] = q(dgu[perm], 0).T @ q(X[perm], 0)
        db13[e] = dgu.sum(0)
        dx.index_put_((tok,), q(dgu, 1) @ q(w13[e], q_w_bwd_axis), accumulate=True)
    return y, dx, dw, dw13, dw2, db13, db2


def _inputs(seed, dtype=torch.float32):
    """Operands with per-element magnitudes spread over 2**-10..2**10.

    With power-of-two block scales, MXFP8 only differs from rounding every value to 3 mantissa
    bits where a block spans more than E4M3's ~17 binades; so the block axis (and the token
    grouping) shows up only in data with such a spread, and the tests below need it.
    """
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * torch.exp2(torch.rand(*shape, generator=g) * 20 - 10)
                * scale).to(dtype)

    x = rnd(T, H)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g).to(dtype)
    w13, w2 = rnd(E, 2 * I, H, scale=H**-0.5 / 32), rnd(E, H, I, scale=I**-0.5 / 32)
    b13, b2 = rnd(E, 2 * I, scale=0.1), rnd(E, H, scale=0.1)
    dy = rnd(T, H)
    return x, ids, w, (w13, w2, b13, b2), dy


def _reference(x, ids, w, p, dy, activation, limit, precision):
    y, saved = reference.experts_forward(x, ids, w, *p, activation, limit, precision=precision)
    dx, dw, g = reference.experts_backward(dy, saved, x, ids, w, *p, activation, limit, precision=precision)
    return y, dx, dw, g.gate_up_proj, g.down_proj, g.gate_up_bias, g.down_bias


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


NAMES = ("y", "dx", "d_topk_weights", "d_gate_up_proj", "d_down_proj", "d_gate_up_bias", "d_down_bias")


@pytest.mark.parametrize("activation,limit", [("swiglu", None), ("swiglu_oai", 7.0)])
def test_reference_mxfp8_matches_float64_model(activation, limit):
    x, ids, w, p, dy = _inputs(0)
    got = _reference(x, ids, w, p, dy, activation, limit, "mxfp8")
    want = model(x, ids, w, p, dy, activation, limit)
    plain = model(x, ids, w, p, dy, activation, limit, q=ident)
    wrong_axis = model(x, ids, w, p, dy, activation, limit, q_w_bwd_axis=1)
    wrong_blocks = model(x, ids, w, p, dy, activation, limit, token_perm=lambda n: torch.arange(n).flip(0))
    for name, a, b, c, d, f in zip(NAMES, got, want, plain, wrong_axis, wrong_blocks):
        err = _rel(a, b)
        assert err < 1e-6, (name, err)
        # the comparison tells the quantisation apart: unquantised math is far off ...
        if name != "d_down_bias":  # (sum_s w dy involves no GEMM)
            assert _rel(c, b) > 1000 * max(err, 1e-8), name
        # ... as are backward weights quantised row-wise instead of column-wise ...
        if name in ("dx", "d_topk_weights"):
            assert _rel(d, b) > 10 * max(err, 1e-8), name
        # ... and weight-gradient token blocks formed in another row order
        if name in ("d_gate_up_proj", "d_down_proj"):
            assert _rel(f, b) > 10 * max(err, 1e-8), name


def test_layer_mxfp8_vs_bf16_error_and_determinism():
    def run(precision):
        torch.manual_seed(0)
        layer = MoKMoELayer(hidden_size=H, intermediate_size=I, num_experts=E, top_k=K, precision=precision,
                            expert_proj_bias=True, backend="reference")
        with torch.no_grad():
            layer.experts.gate_up_proj_bias.normal_(0, 0.1)
            layer.experts.down_proj_bias.normal_(0, 0.1)
        g = torch.Generator().manual_seed(1)
        x = torch.randn(2, T // 2, H, generator=g).bfloat16().requires_grad_(True)
        y = layer(x)
        y.float().mul(torch.randn(y.shape, generator=g)).sum().backward()
        return [y, x.grad, layer.router.weight.grad] + [t.grad for t in layer.experts.parameters()]

    bf16, mx, mx2 = run("bf16"), run("mxfp8"), run("mxfp8")
    names = ("y", "dx", "d_router", "d_gate_up_proj", "d_down_proj", "d_gate_up_bias", "d_down_bias")
    for name, a, b, c in zip(names, mx, bf16, mx2):
        assert torch.equal(a, c), name  # bitwise deterministic
        err = _rel(a, b)
        print(f"mxfp8 vs bf16 relative L2 error, {name}: {err:.3e}")
        assert err < 0.1, (name, err)
        assert err > 0 or name == "d_down_bias", name  # sum_s w dy: no GEMM, not quantised


def test_layer_rejects_bad_mxfp8_config():
    with pytest.raises(ValueError, match="multiples of the MX block size"):
        MoKMoELayer(hidden_size=48, intermediate_size=32, num_experts=4, top_k=2, precision="mxfp8")
    with pytest.raises(ValueError, match="float64"):
        MoKMoELayer(hidden_size=64, intermediate_size=32, num_experts=4, top_k=2, precision="mxfp8",
                    dtype=torch.float64)


# ----------------------------------------------------------------------------- checkpoints into the layer

PREFIX = "model.layers.0.mlp."


def _layer(seed, precision="mxfp8"):
    torch.manual_seed(seed)
    return MoKMoELayer(hidden_size=H, intermediate_size=I, num_experts=E, top_k=K, precision=precision,
                       backend="reference")


def _forward(layer):
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(3)).bfloat16()
    return layer(x)


def test_checkpoint_into_layer_equals_in_memory_quantisation(tmp_path):
    src = _layer(0)
    w13, w2 = src.experts.gate_up_proj.detach(), src.experts.down_proj.detach()
    y_mem = _forward(src)  # quantises its bf16 weights in memory

    # our format, written from the in-memory quantisation (rceil)
    path = tmp_path / "ours.safetensors"
    checkpoint.save_mxfp8(path, checkpoint.quantize_expert_weights(
        {PREFIX + "experts.gate_up_proj": w13, PREFIX + "experts.down_proj": w2,
         PREFIX + "gate.weight": src.router.weight.detach()}))
    dst = _layer(1)
    dst.router.load_state_dict(src.router.state_dict())
    assert not torch.equal(_forward(dst), y_mem)
    checkpoint.load_experts_into_layer(dst, path, PREFIX)
    assert torch.equal(dst.experts.gate_up_proj, fake_quantize(w13))
    assert torch.equal(_forward(dst), y_mem)

    # compressed-tensors per-expert checkpoint written by an OCP "floor" producer: the layer computes
    # on exactly those values, i.e. as a layer holding fake_quantize(W, floor) in memory
    tensors = {}
    for e in range(E):
        for role, m in (("gate_proj", w13[e, :I]), ("up_proj", w13[e, I:]), ("down_proj", w2[e])):
            q = quantize(m, scale_mode="floor")
            tensors[f"{PREFIX}experts.{e}.{role}.weight"] = q.data
            tensors[f"{PREFIX}experts.{e}.{role}.weight_scale"] = q.scale
    from safetensors.torch import save_file
    import json
    (tmp_path / "ct").mkdir()
    save_file(tensors, str(tmp_path / "ct" / "model.safetensors"))
    (tmp_path / "ct" / "config.json").write_text(json.dumps({"quantization_config": {
        "quant_method": "compressed-tensors", "format": "mxfp8-quantized"}}))
    dst2 = _layer(2)
    dst2.router.load_state_dict(src.router.state_dict())
    checkpoint.load_experts_into_layer(dst2, tmp_path / "ct", PREFIX)
    mem = _layer(0)
    with torch.no_grad():
        mem.experts.gate_up_proj.copy_(fake_quantize(w13, scale_mode="floor"))
        mem.experts.down_proj.copy_(fake_quantize(w2, scale_mode="floor"))
    y_floor = _forward(mem)
    assert torch.equal(_forward(dst2), y_floor) and not torch.equal(y_floor, y_mem)


def test_load_experts_shape_mismatch():
    layer = _layer(0)
    bad = {PREFIX + "experts.gate_up_proj": quantize(torch.randn(E, 2 * I, 2 * H)),
           PREFIX + "experts.down_proj": quantize(torch.randn(E, H, I))}
    with pytest.raises(checkpoint.CheckpointFormatError, match="gate_up_proj"):
        checkpoint.load_experts_into_layer(layer, bad, PREFIX)


def test_load_experts_takes_this_ranks_shard():
    from types import SimpleNamespace
    local = _layer(0)  # E=4 experts held as the 2nd of 2 ranks of an 8-expert model
    fake = SimpleNamespace(experts=local.experts, num_experts=2 * E, num_local_experts=E, ep_rank=1,
                           hidden_size=H, intermediate_size=I)
    w13 = torch.randn(2 * E, 2 * I, H).bfloat16()
    w2 = torch.randn(2 * E, H, I).bfloat16()
    tensors = checkpoint.quantize_expert_weights({"experts.gate_up_proj": w13, "experts.down_proj": w2})
    checkpoint.load_experts_into_layer(fake, tensors)
    assert torch.equal(local.experts.gate_up_proj, fake_quantize(w13)[E:])
    assert torch.equal(local.experts.down_proj, fake_quantize(w2)[E:])


def test_load_experts_biases_must_match_the_layer():
    """Expert biases present in the checkpoint but not in the layer (they would be dropped),
    or in the layer but not in the checkpoint (they would keep stale values): an error naming them."""
    g = torch.Generator().manual_seed(7)
    weights = checkpoint.quantize_expert_weights({
        PREFIX + "experts.gate_up_proj": torch.randn(E, 2 * I, H, generator=g).bfloat16(),
        PREFIX + "experts.down_proj": torch.randn(E, H, I, generator=g).bfloat16()})
    biases = {PREFIX + "experts.gate_up_proj_bias": torch.randn(E, 2 * I, generator=g).bfloat16(),
              PREFIX + "experts.down_proj_bias": torch.randn(E, H, generator=g).bfloat16()}
    with pytest.raises(checkpoint.CheckpointFormatError, match="gate_up_proj_bias"):
        checkpoint.load_experts_into_layer(_layer(0), {**weights, **biases}, PREFIX)
    with_bias = MoKMoELayer(hidden_size=H, intermediate_size=I, num_experts=E, top_k=K, expert_proj_bias=True,
                            backend="reference")
    with pytest.raises(checkpoint.CheckpointFormatError, match="down_proj_bias"):
        checkpoint.load_experts_into_layer(with_bias, weights, PREFIX)
    checkpoint.load_experts_into_layer(with_bias, {**weights, **biases}, PREFIX)
    assert torch.equal(with_bias.experts.down_proj_bias, biases[PREFIX + "experts.down_proj_bias"])
