"""mok_nn.integrations.huggingface on tiny random transformers models (CPU).

Each supported architecture: the patched model against the original one, both
float32 (tolerance: 1e-5 relative on logits, 1e-4 on gradients: the two only
differ in summation order), plus state-dict round trips and bad input."""

import copy
import logging
import re

import pytest
import torch

transformers = pytest.importorskip("transformers")
from _tiny_moe_models import ARCHS, VOCAB, build  # noqa: E402
from helpers import gloo_rank  # noqa: E402

from mok_nn.integrations import huggingface as hf  # noqa: E402

HAS_AUX = {"mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss"}   # DeepSeek-V3 has none
RTOL, ATOL = 1e-5, 1e-5


def _inputs(seed=1, batch=2, seq=9):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (batch, seq), generator=g)
    return ids


def _patched(model, **kw):
    return hf.patch_model(copy.deepcopy(model), backend="reference", **kw)


def _num_blocks(model, cls):
    return sum(isinstance(m, cls) for m in model.modules())


def _hf_grads(model):
    """{original parameter name: grad}, translating patched blocks back to HF names/layouts."""
    out, inside = {}, set()
    for name, mod in model.named_modules():
        if isinstance(mod, hf.MoKHFBlock):
            for k, g in mod.hf_tensors(lambda t: t.grad if t.requires_grad else None).items():
                if g is not None:
                    out[f"{name}.{k}"] = g
            inside |= {f"{name}.{n}" for n, _ in mod.named_parameters()}
    for name, p in model.named_parameters():
        if name not in inside and p.grad is not None:
            out[name] = p.grad
    return out


def _assert_same_grads(orig, loss_o, model, loss_p):
    """Backward of both losses; the patched model's gradients (original names) equal the original's."""
    loss_o.backward()
    loss_p.backward()
    g_o = {n: p.grad for n, p in orig.named_parameters() if p.grad is not None}
    g_p = _hf_grads(model)
    # transformers 4.x leaves experts no token reached without a gradient: zero here
    assert set(g_o) <= set(g_p) and all(not g_p[n].any() for n in set(g_p) - set(g_o))
    for name in g_o:
        torch.testing.assert_close(g_p[name], g_o[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_forward_backward_and_aux_loss_match(arch):
    orig = build(arch)
    model = _patched(orig)
    n_orig = sum(type(m).__name__ in hf.SUPPORTED_BLOCKS for m in orig.modules())
    assert n_orig > 0 and _num_blocks(model, hf.MoKHFBlock) == n_orig
    assert not any(type(m).__name__ in hf.SUPPORTED_BLOCKS for m in model.modules())

    ids = _inputs()
    out_o = orig(ids, labels=ids, output_router_logits=True)
    out_p = model(ids, labels=ids, output_router_logits=True)
    torch.testing.assert_close(out_p.logits, out_o.logits, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(out_p.loss, out_o.loss, rtol=RTOL, atol=ATOL)

    # router logits captured for every MoE layer, and the aux loss built from them
    if getattr(out_o, "router_logits", None) is not None:   # DeepSeek-V3 of transformers 4.x has none
        assert len(out_p.router_logits) == len(out_o.router_logits) == n_orig
        for rp, ro in zip(out_p.router_logits, out_o.router_logits):
            torch.testing.assert_close(rp.float(), ro.float(), rtol=RTOL, atol=ATOL)
    if arch in HAS_AUX:
        assert out_o.aux_loss is not None and out_o.aux_loss > 0
        torch.testing.assert_close(out_p.aux_loss, out_o.aux_loss, rtol=RTOL, atol=ATOL)

    # the loss includes router_aux_loss_coef * aux_loss: router gradients check the aux path too
    _assert_same_grads(orig, out_o.loss, model, out_p.loss)


@pytest.mark.parametrize("arch", ["mixtral", "gpt_oss"])
def test_aux_loss_gradient_reaches_router(arch):
    """The captured router logits stay in the autograd graph: aux-loss alone trains the router."""
    orig = build(arch)
    model = _patched(orig)
    ids = _inputs()
    aux_o = orig(ids, output_router_logits=True).aux_loss
    aux_p = model(ids, output_router_logits=True).aux_loss
    aux_o.backward()
    aux_p.backward()
    g_o = {n: p.grad for n, p in orig.named_parameters() if p.grad is not None}
    g_p = _hf_grads(model)
    router = [n for n in g_o if ".router." in n or ".gate.weight" in n]
    assert router
    for n in router:
        assert g_o[n].abs().max() > 0
        torch.testing.assert_close(g_p[n], g_o[n], rtol=1e-4, atol=1e-7, msg=n)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_state_dict_and_save_pretrained_round_trip(arch, tmp_path):
    orig = build(arch)
    model = _patched(orig)
    sd_o, sd_p = orig.state_dict(), model.state_dict()
    assert list(sd_p) == list(sd_o) or set(sd_p) == set(sd_o)
    for k in sd_o:
        assert sd_p[k].shape == sd_o[k].shape, k
        assert torch.equal(sd_p[k], sd_o[k]), k

    # train a step so the saved weights differ from the original ones
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ids = _inputs()
    model.train()
    model(ids, labels=ids).loss.backward()
    opt.step()
    model.eval()
    want = model(_inputs(seed=5)).logits

    model.save_pretrained(tmp_path)
    reloaded = type(orig).from_pretrained(tmp_path, dtype=torch.float32, attn_implementation="eager").eval()
    torch.testing.assert_close(reloaded(_inputs(seed=5)).logits, want, rtol=RTOL, atol=ATOL)
    repatched = hf.patch_model(reloaded, backend="reference")
    assert torch.equal(repatched(_inputs(seed=5)).logits, want)

    # load_state_dict takes an original (unpatched) state dict
    fresh = _patched(build(arch, seed=3))
    fresh.load_state_dict(reloaded.state_dict())
    assert torch.equal(fresh(_inputs(seed=5)).logits, want)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_training_steps_run_and_are_deterministic(arch):
    def run():
        model = _patched(build(arch)).train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for step in range(3):
            ids = _inputs(seed=10 + step)
            loss = model(ids, labels=ids, output_router_logits=True).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        return torch.stack(losses), model.state_dict()

    l1, sd1 = run()
    l2, sd2 = run()
    assert torch.isfinite(l1).all()
    assert torch.equal(l1, l2)
    assert all(torch.equal(sd1[k], sd2[k]) for k in sd1)
    expert = next(k for k in sd1 if ".experts." in k)     # experts trained
    assert not torch.equal(sd1[expert], build(arch).state_dict()[expert])


def test_gpt_oss_block_returns_router_scores():
    orig = build("gpt_oss")
    model = _patched(orig)
    x = torch.randn(2, 5, orig.config.hidden_size)
    y_o, s_o = orig.model.layers[0].mlp(x)
    y_p, s_p = model.model.layers[0].mlp(x)
    torch.testing.assert_close(y_p, y_o, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(s_p, s_o, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("arch", ["mixtral", "deepseek_v3", "gpt_oss"])
def test_bf16_model(arch):
    """bf16 models keep their dtypes, and the patched model is as accurate as the
    original one: max |logits - float32 logits| at most twice the original's
    error plus 1e-3 of the logit scale."""
    orig = build(arch, dtype=torch.bfloat16)
    model = _patched(orig)
    assert {k: v.dtype for k, v in model.state_dict().items()} == {k: v.dtype for k, v in orig.state_dict().items()}
    ids = _inputs()
    ref = build(arch)(ids).logits
    lo, lp = orig(ids).logits.float(), model(ids).logits.float()
    err_o, err_p = (lo - ref).abs().max(), (lp - ref).abs().max()
    assert err_p <= 2 * err_o + 1e-3 * ref.abs().max(), (err_p, err_o)


def test_hooks_installed_before_patching_still_capture_once():
    orig = build("mixtral")
    model = copy.deepcopy(orig)
    ids = _inputs()
    model(ids, output_router_logits=True)        # installs transformers' capture hooks
    hf.patch_model(model, backend="reference")
    out = model(ids, output_router_logits=True, output_hidden_states=True)
    ref = orig(ids, output_router_logits=True, output_hidden_states=True)
    assert len(out.router_logits) == len(ref.router_logits)
    assert len(out.hidden_states) == len(ref.hidden_states)


def test_targets_patch_only_named_blocks():
    orig = build("qwen3_moe")
    model = _patched(orig, targets=["model.layers.1.mlp"])
    assert not isinstance(model.model.layers[0].mlp, hf.MoKHFBlock)
    assert isinstance(model.model.layers[1].mlp, hf.MoKHFBlock)
    ids = _inputs()
    torch.testing.assert_close(model(ids).logits, orig(ids).logits, rtol=RTOL, atol=ATOL)
    by_class = _patched(orig, targets=["Qwen3MoeSparseMoeBlock"])
    assert _num_blocks(by_class, hf.MoKHFBlock) == 2


# ---------------------------------------------------------------- bad input

def test_model_without_moe_blocks_raises():
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=16,
                                   num_hidden_layers=1, num_attention_heads=4)
    with pytest.raises(hf.PatchError, match="no MoE blocks"):
        hf.patch_model(transformers.LlamaForCausalLM(cfg))
    with pytest.raises(hf.PatchError, match="no MoE blocks"):
        hf.patch_model(torch.nn.Sequential(torch.nn.Linear(4, 4)))


def test_unsupported_configuration_is_logged_and_raises_when_nothing_patchable(caplog):
    model = build("mixtral", router_jitter_noise=0.1)
    with caplog.at_level(logging.WARNING, logger=hf.__name__):
        with pytest.raises(hf.PatchError, match="router_jitter_noise"):
            hf.patch_model(model)
    assert "model.layers.0." in caplog.text and "(MixtralSparseMoeBlock) unpatched" in caplog.text
    assert _num_blocks(model, hf.MoKHFBlock) == 0

    with pytest.raises(hf.PatchError, match="(?i)hidden_act.*gelu"):
        hf.patch_model(build("olmoe", hidden_act="gelu"))


def test_explicit_targets_that_cannot_be_patched_raise():
    model = build("mixtral")
    with pytest.raises(hf.PatchError, match="model.layers.7.mlp: no such module"):
        hf.patch_model(model, targets=["model.layers.7.mlp"])
    with pytest.raises(hf.PatchError, match="not a supported MoE block"):
        hf.patch_model(model, targets=["model.layers.0.self_attn"])
    with pytest.raises(hf.PatchError, match="targets is empty"):
        hf.patch_model(model, targets=[])
    assert _num_blocks(model, hf.MoKHFBlock) == 0     # nothing half-patched


def test_patching_twice_is_a_no_op():
    model = _patched(build("olmoe"))
    blocks = [m for m in model.modules() if isinstance(m, hf.MoKHFBlock)]
    assert hf.patch_model(model) is model
    assert blocks == [m for m in model.modules() if isinstance(m, hf.MoKHFBlock)]



def test_interleave_helpers_against_explicit_indexing():
    t = torch.randn(3, 5, 8)
    d = hf.deinterleave(t, 2)
    assert torch.equal(d[..., :4], t[..., [0, 2, 4, 6]]) and torch.equal(d[..., 4:], t[..., [1, 3, 5, 7]])
    assert torch.equal(hf.interleave(d, 2), t)


# ---------------------------------------------------------------- expert parallelism

def _ep_worker(rank, world, tmpdir, arch):
    import torch.distributed as dist

    with gloo_rank(rank, world, tmpdir):
        orig = build(arch)                                   # same seed: same model on every rank
        model = hf.patch_model(copy.deepcopy(orig), backend="reference", ep_group=dist.group.WORLD)
        batches = [_inputs(seed=20 + r) for r in range(world)]
        out = model(batches[rank], labels=batches[rank])
        out.loss.backward()

        own = copy.deepcopy(orig)                            # this rank's tokens only
        ref = own(batches[rank], labels=batches[rank])
        torch.testing.assert_close(out.logits, ref.logits, rtol=RTOL, atol=ATOL)
        ref.loss.backward()
        every = copy.deepcopy(orig)                          # all ranks' tokens: full expert gradients
        for ids in batches:
            every(ids, labels=ids).loss.backward()

        g_own = {n: p.grad for n, p in own.named_parameters() if p.grad is not None}
        g_all = {n: p.grad for n, p in every.named_parameters() if p.grad is not None}
        g_ep = _hf_grads(model)
        sd_ep, sd_full = model.state_dict(), orig.state_dict()
        assert set(sd_ep) <= set(sd_full) and set(g_ep) <= set(sd_full)
        assert {n for n in sd_full if ".experts." not in n} <= set(sd_ep)
        for name, g in g_ep.items():
            full = sd_full[name]
            if ".experts." in name and sd_ep[name].shape != full.shape:
                # a fused [E, ...] tensor: this rank's shard of the all-token gradient
                local = sd_ep[name].shape[0]
                assert local * world == full.shape[0]
                rows = slice(rank * local, (rank + 1) * local)
                assert torch.equal(sd_ep[name], full[rows]), name
                want = g_all[name][rows]
            elif ".experts." in name:
                # transformers 4.x per-expert tensors: this rank holds some of them, whole
                assert torch.equal(sd_ep[name], full), name
                want = g_all.get(name, torch.zeros_like(full))
            else:                                            # router, attention: this rank's tokens
                want = g_own.get(name, torch.zeros_like(full))
            torch.testing.assert_close(g, want, rtol=1e-4, atol=1e-6, msg=name)

        # a full (unsharded) checkpoint loads into the expert-parallel model: each rank keeps its shard
        fresh = hf.patch_model(build(arch, seed=3), backend="reference", ep_group=dist.group.WORLD)
        fresh.load_state_dict(sd_full)
        assert torch.equal(fresh(batches[rank]).logits, model(batches[rank]).logits)


@pytest.mark.parametrize("arch", ["mixtral", "gpt_oss"])
def test_expert_parallel_patch_over_gloo(arch, tmp_path):
    """ep_group of 2 CPU processes: each rank holds half the experts; outputs equal the
    original model's, expert gradients are the local shard of the all-token gradient."""
    import torch.multiprocessing as mp

    mp.spawn(_ep_worker, args=(2, str(tmp_path), arch), nprocs=2, join=True)


# ---------------------------------------------------------------- MXFP8

MX_SIZES = dict(hidden_size=64, intermediate_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                head_dim=16)


def _mx_model(arch, seed=0):
    kw = {k: v for k, v in MX_SIZES.items() if k != "head_dim" or arch in ("qwen3_moe", "gpt_oss")}
    if arch in ("mixtral", "olmoe", "gpt_oss"):
        kw["intermediate_size"] = 32      # their experts' size
    return build(arch, seed=seed, **kw)


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "gpt_oss"])
def test_mxfp8_precision_reaches_every_layer(arch):
    """precision='mxfp8' is handed to every MoKMoELayer (whose MXFP8 arithmetic has its own
    tests): outputs move by the size of an MXFP8 quantisation error, master weights stay."""
    orig = _mx_model(arch)
    full = _patched(orig)
    mx = _patched(orig, precision="mxfp8")
    blocks = [m for m in mx.modules() if isinstance(m, hf.MoKHFBlock)]
    assert blocks and all(m.mok.precision == "mxfp8" for m in blocks)
    ids = _inputs()
    l_full, l_mx = full(ids).logits, mx(ids).logits
    rel = (l_mx - l_full).abs().max() / l_full.abs().max()
    assert 1e-4 < rel < 0.1, rel
    sd = mx.state_dict()
    assert all(torch.equal(sd[k], v) for k, v in orig.state_dict().items())


def test_mxfp8_precision_needs_multiples_of_32():
    with pytest.raises(hf.PatchError, match="multiples of the MX block size 32"):
        hf.patch_model(build("mixtral"), precision="mxfp8")
    with pytest.raises(ValueError, match="precision must be"):
        hf.patch_model(build("mixtral"), precision="fp4")


@pytest.mark.parametrize("arch", ["mixtral", "deepseek_v3", "gpt_oss"])
def test_mxfp8_checkpoint_round_trip(arch, tmp_path):
    """save_mxfp8_checkpoint -> load_mxfp8_checkpoint into a fresh patched model: the
    expert weights arrive as their MXFP8 values, so an mxfp8 model gives bitwise the
    outputs of the source mxfp8 model (requantising MXFP8 values is exact)."""
    from safetensors import safe_open

    src = _patched(_mx_model(arch), precision="mxfp8")
    path = tmp_path / "model.safetensors"
    hf.save_mxfp8_checkpoint(src, path)
    with safe_open(str(path), "pt") as f:
        names = set(f.keys())
        expert = next(n for n in names if n.endswith("experts.gate_up_proj") or n.endswith(".w1.weight")
                      or n.endswith("gate_proj.weight") and ".experts." in n)
        assert f.get_tensor(expert).dtype == torch.float8_e4m3fn and expert + "_scale" in names
    assert {n for n in names if not n.endswith("_scale")} == set(src.state_dict())

    dst = _patched(_mx_model(arch, seed=5), precision="mxfp8")
    missing, unexpected = hf.load_mxfp8_checkpoint(dst, path)
    assert not missing and not unexpected
    ids = _inputs()
    assert torch.equal(dst(ids).logits, src(ids).logits)
    # the loaded expert weights are the MXFP8 values of the source's (quantised along K)
    from mok_nn import mxfp8

    for a, b in zip([m for m in src.modules() if isinstance(m, hf.MoKHFBlock)],
                    [m for m in dst.modules() if isinstance(m, hf.MoKHFBlock)]):
        for w in ("gate_up_proj", "down_proj"):
            want = mxfp8.fake_quantize(getattr(a.mok.experts, w).detach())
            assert torch.equal(getattr(b.mok.experts, w), want)
            assert not torch.equal(getattr(b.mok.experts, w), getattr(a.mok.experts, w))
    # a bf16-precision model takes the same values
    plain = _patched(_mx_model(arch, seed=5))
    hf.load_mxfp8_checkpoint(plain, path)
    assert all(torch.equal(v, dst.state_dict()[k]) for k, v in plain.state_dict().items())


def test_mxfp8_checkpoint_from_already_read_dict(tmp_path):
    """load_mxfp8_checkpoint takes the dict load_mxfp8_tensors returned, with the fused and with the
    w13/w2 naming: the same state as loading the file, and the caller's dict is left as it was."""
    from mok_nn import checkpoint, mxfp8

    src = _patched(_mx_model("qwen3_moe"), precision="mxfp8")
    path = tmp_path / "model.safetensors"
    hf.save_mxfp8_checkpoint(src, path)
    from_file = _patched(_mx_model("qwen3_moe", seed=5), precision="mxfp8")
    hf.load_mxfp8_checkpoint(from_file, path)
    read = checkpoint.load_mxfp8_tensors(path)
    names = set(read)
    from_dict = _patched(_mx_model("qwen3_moe", seed=7), precision="mxfp8")
    assert hf.load_mxfp8_checkpoint(from_dict, read) == ([], [])
    assert set(read) == names
    assert all(torch.equal(v, from_file.state_dict()[k]) for k, v in from_dict.state_dict().items())
    w13 = dict(src.state_dict())
    for name, block in [(n, m) for n, m in src.named_modules() if isinstance(m, hf.MoKHFBlock)]:
        for n in block.hf_tensors():
            if n.startswith("experts."):
                w13.pop(f"{name}.{n}")
        w13[f"{name}.experts.w13_weight"] = mxfp8.quantize(block.mok.experts.gate_up_proj.detach())
        w13[f"{name}.experts.w2_weight"] = mxfp8.quantize(block.mok.experts.down_proj.detach())
    from_w13 = _patched(_mx_model("qwen3_moe", seed=9), precision="mxfp8")
    assert hf.load_mxfp8_checkpoint(from_w13, w13) == ([], [])
    ids = _inputs()
    assert torch.equal(from_w13(ids).logits, src(ids).logits)


def test_mxfp8_checkpoint_with_fused_w13_names(tmp_path):
    """Expert weights stored as ModelOpt/vLLM-style w13_weight / w2_weight load too."""
    from mok_nn import checkpoint, mxfp8

    src = _patched(_mx_model("qwen3_moe"), precision="mxfp8")
    tensors = dict(src.state_dict())
    for name, block in [(n, m) for n, m in src.named_modules() if isinstance(m, hf.MoKHFBlock)]:
        for n in block.hf_tensors():
            if n.startswith("experts."):          # 5.x fused or 4.x per-expert names
                tensors.pop(f"{name}.{n}")
        tensors[f"{name}.experts.w13_weight"] = mxfp8.quantize(block.mok.experts.gate_up_proj.detach())
        tensors[f"{name}.experts.w2_weight"] = mxfp8.quantize(block.mok.experts.down_proj.detach())
    path = tmp_path / "w13.safetensors"
    checkpoint.save_mxfp8(path, tensors)
    dst = _patched(_mx_model("qwen3_moe", seed=5), precision="mxfp8")
    assert hf.load_mxfp8_checkpoint(dst, path) == ([], [])
    ids = _inputs()
    assert torch.equal(dst(ids).logits, src(ids).logits)


def test_block_fp8_checkpoint_dequantised_directly_for_bf16_precision(tmp_path):
    """Expert weights stored as DeepSeek-V3 block FP8 (w13_weight / w2_weight, non-power-of-two
    scale_inv per 128x128 block): a precision="bf16" model holds fp8 * scale_inv (fp32 product, one
    cast), a precision="mxfp8" model the MXFP8 requantisation of those values."""
    from safetensors.torch import save_file

    from mok_nn import mxfp8

    src = _patched(_mx_model("qwen3_moe"))
    tensors, want = dict(src.state_dict()), {}
    for name, block in [(n, m) for n, m in src.named_modules() if isinstance(m, hf.MoKHFBlock)]:
        for n in block.hf_tensors():
            if n.startswith("experts."):
                tensors.pop(f"{name}.{n}")
        for key, w in (("w13_weight", block.mok.experts.gate_up_proj), ("w2_weight", block.mok.experts.down_proj)):
            w = w.detach().float()
            e, n, k = w.shape
            s = torch.rand(e, -(-n // 128), -(-k // 128)) * 3e-4 + 1e-4
            s_full = s.repeat_interleave(128, 1).repeat_interleave(128, 2)[:, :n, :k]
            data = (w / s_full).clamp(-448, 448).to(torch.float8_e4m3fn)
            tensors[f"{name}.experts.{key}"], tensors[f"{name}.experts.{key}_scale_inv"] = data, s
            want[(name, key)] = data.double().numpy().astype("float32") * s_full.numpy()   # fp32 product
    path = tmp_path / "ds.safetensors"
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    for precision in ("bf16", "mxfp8"):
        dst = _patched(_mx_model("qwen3_moe", seed=5), precision=precision)
        assert hf.load_mxfp8_checkpoint(dst, path) == ([], [])
        for name, block in [(n, m) for n, m in dst.named_modules() if isinstance(m, hf.MoKHFBlock)]:
            for key, param in (("w13_weight", block.mok.experts.gate_up_proj),
                               ("w2_weight", block.mok.experts.down_proj)):
                values = want[(name, key)]
                exact = torch.from_numpy(values).to(param.dtype)
                expected = exact if precision == "bf16" else mxfp8.quantize(torch.from_numpy(values)).dequantize(
                    param.dtype)
                assert torch.equal(param.detach(), expected), (precision, name, key)
                assert precision == "bf16" or not torch.equal(expected, exact)


def test_mxfp8_checkpoint_with_scaled_data_of_wrong_dtype_raises(tmp_path):
    """An expert tensor stored next to its scale but not as float8_e4m3fn (here the FP8 values
    as fp32) raises naming it and its dtype, also with strict=True, and leaves the model unchanged."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from mok_nn import checkpoint

    src = _patched(_mx_model("mixtral"), precision="mxfp8")
    path = tmp_path / "model.safetensors"
    hf.save_mxfp8_checkpoint(src, path)
    with safe_open(str(path), "pt") as f:
        meta, tensors = f.metadata(), {n: f.get_tensor(n) for n in f.keys()}
    name = sorted(n for n in tensors if n + "_scale" in tensors)[-1]
    tensors[name] = tensors[name].float()
    bad = tmp_path / "bad.safetensors"
    save_file(tensors, str(bad), metadata=meta)
    dst = _patched(_mx_model("mixtral", seed=5), precision="mxfp8")
    before = {k: v.clone() for k, v in dst.state_dict().items()}
    with pytest.raises(checkpoint.CheckpointFormatError, match=rf"{re.escape(name)}'.*torch\.float32"):
        hf.load_mxfp8_checkpoint(dst, bad, strict=True)
    assert all(torch.equal(v, before[k]) for k, v in dst.state_dict().items())


def test_mxfp8_checkpoint_mismatch_raises(tmp_path):
    from mok_nn import checkpoint

    src = _patched(_mx_model("mixtral"), precision="mxfp8")
    path = tmp_path / "m.safetensors"
    hf.save_mxfp8_checkpoint(src, path)
    other = _patched(_mx_model("olmoe"), precision="mxfp8")
    with pytest.raises(checkpoint.CheckpointFormatError):
        hf.load_mxfp8_checkpoint(other, path)
    with pytest.raises(hf.PatchError, match="patched with patch_model"):
        hf.load_mxfp8_checkpoint(_mx_model("mixtral"), path)


def test_autocast_bf16_input_over_fp32_weights():
    """Under autocast a block may get bf16 hidden states while its weights are fp32:
    the patched block computes in fp32 and returns the input's dtype."""
    orig = build("qwen2_moe")
    model = _patched(orig)
    x = torch.randn(2, 5, orig.config.hidden_size).to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        yo = orig.model.layers[0].mlp(x)
        yp = model.model.layers[0].mlp(x)
    if isinstance(yo, tuple):          # transformers 4.x: (hidden, router_logits)
        yo, yp = yo[0], yp[0]
    assert yp.dtype == x.dtype == yo.dtype
    assert (yp.float() - yo.float()).abs().max() <= 0.05 * yo.float().abs().max()


def test_gradient_checkpointing():
    """With activation (gradient) checkpointing the forwards are recomputed: the
    patched model still has the original model's gradients and router-logit capture."""
    orig, model = build("qwen3_moe").train(), _patched(build("qwen3_moe")).train()
    for m in (orig, model):
        enable = getattr(m, "activation_checkpointing_enable", None) or m.gradient_checkpointing_enable
        enable()
    ids = _inputs()
    out_o = orig(ids, labels=ids, output_router_logits=True)
    out_p = model(ids, labels=ids, output_router_logits=True)
    assert len(out_o.router_logits) == len(out_p.router_logits) == 2
    _assert_same_grads(orig, out_o.loss, model, out_p.loss)


def test_patch_hf_model_example_runs(capsys):
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "patch_hf_model.py"
    spec = importlib.util.spec_from_file_location("patch_hf_model", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    example.main()
    out = capsys.readouterr().out
    assert "patched 2 MoE blocks" in out
    losses = [float(line.split()[-1]) for line in out.splitlines() if line.startswith("step ")]
    assert len(losses) == 8 and losses[-1] < losses[0]


def test_patch_hf_model_example_has_an_argument_parser():
    """--help prints the usage and exits 0 without running the demo; an unknown argument is an error."""
    import os
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    script = [sys.executable, str(root / "examples" / "patch_hf_model.py")]
    ok = subprocess.run(script + ["--help"], capture_output=True, text=True, env=env, timeout=300)
    assert ok.returncode == 0 and ok.stdout.startswith("usage:") and "patched" not in ok.stdout, ok
    bad = subprocess.run(script + ["--no-such-option"], capture_output=True, text=True, env=env, timeout=300)
    assert bad.returncode == 2 and "unrecognized arguments: --no-such-option" in bad.stderr, bad
    assert "patched" not in bad.stdout
