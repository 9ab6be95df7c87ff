"""mok_nn.integrations.megatron on CPU, without megatron-core: config translation,
routing conversion and state-dict mapping, checked against an independent
float64 implementation of Megatron-core's MoE layer math (router, fc1 = [gate; up]
experts, shared expert with sigmoid gate).  The Megatron layer itself needs CUDA:
examples/megatron_check.py compares it with the real Megatron layer on a GPU."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from mok_nn import MoKMoELayer
from mok_nn.integrations import megatron as mg

H, I, E, IS = 16, 8, 8, 12


def quick_gelu(x):   # named like Megatron's fused_bias_geglu.quick_gelu
    return x * torch.sigmoid(1.702 * x)


def _cfg(**kw):
    base = dict(hidden_size=H, moe_ffn_hidden_size=I, num_moe_experts=E, moe_router_topk=2,
                gated_linear_unit=True, activation_func=F.silu, glu_linear_offset=0.0,
                activation_func_clamp_value=None, moe_router_score_function="softmax",
                moe_router_pre_softmax=False, moe_router_num_groups=None, moe_router_group_topk=None,
                moe_router_topk_scaling_factor=None, moe_router_enable_expert_bias=False,
                moe_shared_expert_intermediate_size=None, moe_shared_expert_gate=False,
                add_bias_linear=False, moe_expert_capacity_factor=None, moe_mlp_glu_interleave_size=None,
                expert_tensor_parallel_size=1, tensor_model_parallel_size=1, moe_latent_size=None,
                moe_router_load_balancing_type="aux_loss", moe_input_jitter_eps=None)
    base.update(kw)
    return SimpleNamespace(**base)


CONFIGS = {
    "softmax_topk_then_softmax": _cfg(),
    "softmax_pre_softmax_scaled": _cfg(moe_router_pre_softmax=True, moe_router_topk_scaling_factor=2.0),
    "deepseek_v3_like": _cfg(moe_router_score_function="sigmoid", moe_router_topk=4, moe_router_num_groups=4,
                             moe_router_group_topk=2, moe_router_topk_scaling_factor=2.5,
                             moe_router_enable_expert_bias=True, moe_shared_expert_intermediate_size=IS),
    "qwen2_like_shared_gate": _cfg(moe_shared_expert_intermediate_size=IS, moe_shared_expert_gate=True),
    "silu_clamped": _cfg(activation_func_clamp_value=3.0),
    "gpt_oss_like": _cfg(activation_func=quick_gelu, glu_linear_offset=1.0, activation_func_clamp_value=1.5,
                         add_bias_linear=True),
}


def _megatron_state_dict(cfg, layout, seed=0):
    """Random state dict of one Megatron MoE layer, in Megatron's names and layouts."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s, std=0.3: torch.randn(*s, generator=g, dtype=torch.float64) * std  # noqa: E731
    sd = {"router.weight": r(E, H, std=1.0)}
    if cfg.add_bias_linear:
        sd["router.bias"] = r(E)
    if cfg.moe_router_enable_expert_bias:
        sd["router.expert_bias"] = r(E, std=0.1)
    for fc, shape in (("1", (2 * I, H)), ("2", (H, I))):
        if layout == "grouped_single":
            sd[f"experts.linear_fc{fc}.weight"] = r(E, *shape)
            if cfg.add_bias_linear:
                sd[f"experts.linear_fc{fc}.bias"] = r(E, shape[0])
            continue
        for i in range(E):
            names = ([f"experts.linear_fc{fc}.weight{i}", f"experts.linear_fc{fc}.bias{i}"] if layout == "grouped"
                     else [f"experts.local_experts.{i}.linear_fc{fc}.weight",
                           f"experts.local_experts.{i}.linear_fc{fc}.bias"])
            sd[names[0]] = r(*shape)
            if cfg.add_bias_linear:
                sd[names[1]] = r(shape[0])
    if cfg.moe_shared_expert_intermediate_size:
        sd["shared_experts.linear_fc1.weight"] = r(2 * IS, H)
        sd["shared_experts.linear_fc2.weight"] = r(H, IS)
        if cfg.moe_shared_expert_gate:
            sd["shared_experts.gate_weight"] = r(1, H)
    return sd


def _megatron_reference(cfg, sd, layout, x):
    """Megatron-core's MoE layer function, written from its definition, in float64."""
    k = cfg.moe_router_topk
    logits = x @ sd["router.weight"].T + sd.get("router.bias", 0)
    if cfg.moe_router_score_function == "softmax":
        if cfg.moe_router_pre_softmax:
            probs, ids = logits.softmax(-1).topk(k, dim=-1)
        else:
            top, ids = logits.topk(k, dim=-1)
            probs = top.softmax(-1)
    else:
        scores = logits.sigmoid()
        choice = scores + sd.get("router.expert_bias", 0)
        if cfg.moe_router_group_topk:
            ng, gk = cfg.moe_router_num_groups, cfg.moe_router_group_topk
            gs = choice.view(-1, ng, E // ng).topk(k // gk, dim=-1).values.sum(-1)
            keep = torch.zeros_like(gs).scatter(1, gs.topk(gk, dim=-1).indices, 1).bool()
            choice = choice.masked_fill(~keep.repeat_interleave(E // ng, dim=1), float("-inf"))
        ids = choice.topk(k, dim=-1).indices
        probs = scores.gather(1, ids)
        probs = probs / (probs.sum(-1, keepdim=True) + 1e-20) if k > 1 else probs
    if cfg.moe_router_topk_scaling_factor:
        probs = probs * cfg.moe_router_topk_scaling_factor

    def w(i, fc, kind):
        if layout == "grouped_single":
            t = sd.get(f"experts.linear_fc{fc}.{kind}")
            return 0 if t is None else t[i]
        key = (f"experts.linear_fc{fc}.{kind}{i}" if layout == "grouped"
               else f"experts.local_experts.{i}.linear_fc{fc}.{kind}")
        return sd.get(key, 0)

    def glu(h):  # Megatron's MLP activation, routed and shared experts alike
        gate, up = h.chunk(2, dim=-1)
        if cfg.activation_func_clamp_value is not None:
            c = cfg.activation_func_clamp_value
            gate, up = gate.clamp(max=c), up.clamp(-c, c)
        return cfg.activation_func(gate) * (up + cfg.glu_linear_offset)

    y = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(k):
            e = int(ids[t, j])
            a = glu(w(e, 1, "weight") @ x[t] + w(e, 1, "bias"))
            y[t] += probs[t, j] * (w(e, 2, "weight") @ a + w(e, 2, "bias"))
    if cfg.moe_shared_expert_intermediate_size:
        s = glu(x @ sd["shared_experts.linear_fc1.weight"].T) @ sd["shared_experts.linear_fc2.weight"].T
        if cfg.moe_shared_expert_gate:
            s = s * torch.sigmoid(x @ sd["shared_experts.gate_weight"].T)
        y = y + s
    return y


@pytest.mark.parametrize("layout", ["grouped", "grouped_single", "sequential"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_converted_layer_computes_megatron_function(name, layout):
    cfg = CONFIGS[name]
    sd = _megatron_state_dict(cfg, layout)
    layer = MoKMoELayer(**mg.mok_layer_kwargs(cfg), backend="reference", dtype=torch.float32)
    mok_sd = mg.megatron_to_mok_state_dict({"decoder.layers.3.mlp." + k: v for k, v in sd.items()},
                                           prefix="decoder.layers.3.mlp.")
    layer.load_state_dict({k: v.float() for k, v in mok_sd.items()}, strict=True)
    x = torch.randn(24, H, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    want = _megatron_reference(cfg, sd, layout, x)
    got = layer(x.float())
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", ["grouped", "grouped_single", "sequential"])
def test_state_dict_round_trip(layout):
    cfg = CONFIGS["deepseek_v3_like"]
    sd = {"p." + k: v for k, v in _megatron_state_dict(cfg, layout).items()}
    back = mg.mok_to_megatron_state_dict(mg.megatron_to_mok_state_dict(sd, "p."), "p.", layout)
    assert set(back) == set(sd)
    assert all(torch.equal(back[k], sd[k]) for k in sd)
    mok = mg.megatron_to_mok_state_dict(sd, "p.")
    assert mok["experts.gate_up_proj"].shape == (E, 2 * I, H) and mok["experts.down_proj"].shape == (E, H, I)
    i = 5
    key = {"grouped": f"p.experts.linear_fc1.weight{i}", "sequential": f"p.experts.local_experts.{i}.linear_fc1.weight",
           "grouped_single": "p.experts.linear_fc1.weight"}[layout]
    want = sd[key][i] if layout == "grouped_single" else sd[key]
    assert torch.equal(mok["experts.gate_up_proj"][i], want)          # fc1 = [gate; up] rows kept


@pytest.mark.parametrize("te_layout", ["grouped", "grouped_single"])
def test_inconsistent_expert_keys_raise_naming_them(te_layout):
    """TEGroupedMLP and SequentialMLP expert keys in one state dict (one used to overwrite the other),
    linear_fc1 without linear_fc2 (weights or biases) and different expert counts raise naming keys."""
    cfg = CONFIGS["gpt_oss_like"]                       # expert biases too
    seed = int(torch.randint(0, 2**30, ()))
    te = {"p." + k: v for k, v in _megatron_state_dict(cfg, te_layout, seed).items()}
    seq = {"p." + k: v for k, v in _megatron_state_dict(cfg, "sequential", seed + 1).items()}
    fc2_te = [k for k in te if ".linear_fc2." in k]
    fc2_seq = [k for k in seq if ".linear_fc2." in k]
    mixed_cases = ({**te, **seq},                                                   # both in full
                   {**{k: v for k, v in te.items() if k not in fc2_te}, **{k: seq[k] for k in fc2_seq}})  # fc1 / fc2
    for sd in mixed_cases:
        with pytest.raises(ValueError, match=r"both layouts.*p\.experts\.linear_fc1\..*p\.experts\.local_experts\.0\."):
            mg.megatron_to_mok_state_dict(sd, "p.")
    for base in (te, seq):
        no_fc2 = {k: v for k, v in base.items() if ".linear_fc2." not in k}
        with pytest.raises(ValueError, match=r"linear_fc1 \(e\.g\. \['p\.experts\..*linear_fc1\.weight.*no linear_fc2 weight"):
            mg.megatron_to_mok_state_dict(no_fc2, "p.")
        no_fc2_bias = {k: v for k, v in base.items() if not (".linear_fc2.bias" in k)}
        with pytest.raises(ValueError, match=r"p\.experts\..*linear_fc1\.bias.*no linear_fc2 bias"):
            mg.megatron_to_mok_state_dict(no_fc2_bias, "p.")
        no_fc1 = {k: v for k, v in base.items() if ".linear_fc1." not in k}
        with pytest.raises(ValueError, match=r"linear_fc2 \(e\.g\. \['p\.experts\..*no linear_fc1"):
            mg.megatron_to_mok_state_dict(no_fc1, "p.")
    fewer = {k: v for k, v in seq.items() if not k.startswith(f"p.experts.local_experts.{E - 1}.linear_fc2.")}
    with pytest.raises(ValueError, match=rf"different numbers of experts.*\({E} experts\).*\({E - 1} experts\)"):
        mg.megatron_to_mok_state_dict(fewer, "p.")
    # each on its own still converts
    for base in (te, seq):
        assert mg.megatron_to_mok_state_dict(base, "p.")["experts.down_proj"].shape == (E, H, I)


def test_mok_layer_kwargs_translation():
    assert mg.mok_layer_kwargs(CONFIGS["softmax_topk_then_softmax"]) == dict(
        hidden_size=H, intermediate_size=I, num_experts=E, top_k=2, score_func="softmax", norm_topk_prob=True,
        use_expert_bias=False, expert_proj_bias=False, router_bias=False, activation="swiglu", swiglu_limit=None)
    kw = mg.mok_layer_kwargs(CONFIGS["deepseek_v3_like"])
    assert (kw["score_func"], kw["norm_topk_prob"], kw["n_group"], kw["topk_group"], kw["routed_scaling_factor"],
            kw["use_expert_bias"], kw["shared_intermediate_size"], kw["shared_expert_gate"]) == (
        "sigmoid", True, 4, 2, 2.5, True, IS, False)
    assert mg.mok_layer_kwargs(CONFIGS["softmax_pre_softmax_scaled"])["norm_topk_prob"] is False
    kw = mg.mok_layer_kwargs(CONFIGS["gpt_oss_like"])
    assert (kw["activation"], kw["swiglu_limit"], kw["expert_proj_bias"], kw["router_bias"]) == (
        "swiglu_oai", 1.5, True, True)


@pytest.mark.parametrize("change, message", [
    (dict(moe_expert_capacity_factor=1.0), "token dropping"),
    (dict(moe_mlp_glu_interleave_size=32), "interleaved GLU"),
    (dict(expert_tensor_parallel_size=2), "expert_tensor_parallel_size"),
    (dict(gated_linear_unit=False), "gated_linear_unit=False"),
    (dict(activation_func=F.gelu), "activation_func=gelu"),
    (dict(moe_latent_size=4), "latent"),
])
def test_unsupported_configs_raise(change, message):
    cfg = _cfg(**change)
    with pytest.raises(mg.MegatronConfigError, match=message):
        mg.check_config(cfg)
    with pytest.raises(mg.MegatronConfigError, match=message):
        mg.mok_layer_kwargs(cfg)


@pytest.mark.parametrize("activation", [
    dict(activation_func=quick_gelu, glu_linear_offset=1.0, activation_func_clamp_value=7.0),   # swiglu_oai
    dict(activation_func_clamp_value=7.0),                                                        # clamped silu
])
def test_shared_expert_with_other_activation_raises(activation):
    """Megatron's shared expert uses the config's activation, offset and clamp; MoKMoELayer's is plain
    SwiGLU: a standalone layer would compute another function there. Without a shared expert the same
    activation translates (the routed experts have it)."""
    cfg = _cfg(moe_shared_expert_intermediate_size=IS, **activation)
    mg.check_config(cfg)          # MoKMegatronMoELayer keeps Megatron's own shared expert
    with pytest.raises(mg.MegatronConfigError, match="shared expert.*clamp"):
        mg.mok_layer_kwargs(cfg)
    kw = mg.mok_layer_kwargs(_cfg(**activation))
    assert kw["swiglu_limit"] == 7.0 and "shared_intermediate_size" not in kw


@pytest.mark.parametrize("change, message", [
    (dict(moe_router_score_function="sqrtsoftplus"), "sqrtsoftplus"),
    (dict(moe_router_topk=6, moe_router_num_groups=4, moe_router_group_topk=2), "best 2 experts"),
    (dict(moe_router_load_balancing_type="sinkhorn"), "sinkhorn"),
])
def test_router_without_mok_equivalent_raises_but_routed_path_is_fine(change, message):
    cfg = _cfg(**change)
    mg.check_config(cfg)          # Megatron's own router is kept by MoKMegatronMoELayer
    with pytest.raises(mg.MegatronConfigError, match=message):
        mg.mok_layer_kwargs(cfg)


def test_topk_from_routing_map():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(10, E, generator=g, requires_grad=True)
    top = logits.topk(3, dim=-1)
    probs = torch.zeros_like(logits).scatter(1, top.indices, top.values.softmax(-1))
    rmap = torch.zeros(10, E, dtype=torch.bool).scatter(1, top.indices, True)
    ids, w = mg.topk_from_routing_map(probs, rmap, 3)
    assert ids.dtype == torch.int64 and torch.equal(ids, top.indices.sort(-1).values)
    torch.testing.assert_close(w, probs.gather(1, ids))
    w.sum().backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="exactly top_k=3"):
        mg.topk_from_routing_map(probs, rmap & (torch.arange(E) != int(ids[0, 0])), 3)
    # without a host synchronisation (the default on a GPU): the token routed to 2 experts gets NaN weights, the
    # others their probabilities
    dropped = rmap.clone()
    dropped[0, int(ids[0, 0])] = False  # token 0 only
    ids2, w2 = mg.topk_from_routing_map(probs, dropped, 3, check="nan")
    assert torch.isnan(w2[0]).all() and not torch.isnan(w2[1:]).any()
    torch.testing.assert_close(w2[1:], probs.gather(1, ids2)[1:])


class _Lin(torch.nn.Module):
    def __init__(self, out_f, in_f, bias):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(out_f, in_f))
        self.bias = torch.nn.Parameter(torch.randn(out_f)) if bias else None


class _GroupedLin(torch.nn.Module):
    def __init__(self, n, out_f, in_f):
        super().__init__()
        for i in range(n):
            self.register_parameter(f"weight{i}", torch.nn.Parameter(torch.randn(out_f, in_f)))


def test_stack_expert_weights_for_both_megatron_layouts():
    seq = torch.nn.Module()
    seq.local_experts = torch.nn.ModuleList()
    for _ in range(3):
        m = torch.nn.Module()
        m.linear_fc1, m.linear_fc2 = _Lin(2 * I, H, True), _Lin(H, I, True)
        seq.local_experts.append(m)
    gu, dn, b1, b2 = mg.stack_expert_weights(seq)
    assert gu.shape == (3, 2 * I, H) and dn.shape == (3, H, I) and b1.shape == (3, 2 * I) and b2.shape == (3, H)
    assert torch.equal(gu[2], seq.local_experts[2].linear_fc1.weight)
    (gu.sum() + dn.sum()).backward()
    assert torch.equal(seq.local_experts[1].linear_fc1.weight.grad, torch.ones(2 * I, H))

    grouped = torch.nn.Module()
    grouped.linear_fc1, grouped.linear_fc2 = _GroupedLin(12, 2 * I, H), _GroupedLin(12, H, I)
    gu, dn, b1, b2 = mg.stack_expert_weights(grouped)
    assert gu.shape == (12, 2 * I, H) and b1 is None and b2 is None
    assert torch.equal(gu[10], grouped.linear_fc1.weight10)     # numeric, not lexicographic, order

    single = torch.nn.Module()                                   # moe_single_grouped_weight: no copy
    single.linear_fc1, single.linear_fc2 = _Lin(2 * I, H, False), _Lin(H, I, False)
    single.linear_fc1.weight = torch.nn.Parameter(torch.randn(4, 2 * I, H))
    single.linear_fc2.weight = torch.nn.Parameter(torch.randn(4, H, I))
    gu, dn, _, _ = mg.stack_expert_weights(single)
    assert gu is single.linear_fc1.weight and dn is single.linear_fc2.weight
    with pytest.raises(TypeError, match="unrecognised Megatron experts module"):
        mg.stack_expert_weights(torch.nn.Linear(2, 2))


@pytest.mark.skipif(mg.HAVE_MEGATRON, reason="megatron-core is installed")
def test_spec_needs_megatron():
    with pytest.raises(ImportError, match="megatron-core"):
        mg.get_mok_moe_module_spec(num_experts=8)


def test_megatron_layer_against_real_megatron_on_cpu(monkeypatch):
    """With megatron-core importable (CI has none: 0.19 needs Python >= 3.12; an
    unpacked wheel on PYTHONPATH works on 3.11), run examples/megatron_check.py's
    cases on CPU: Megatron's router asks for the current CUDA device, pointed
    here at the CPU, and the all-gather dispatcher needs no CUDA streams."""
    pytest.importorskip("megatron.core.transformer.moe.moe_layer")
    import importlib.util
    import os
    import pathlib

    import torch.distributed as dist
    from megatron.core import parallel_state

    path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "megatron_check.py"
    spec = importlib.util.spec_from_file_location("megatron_check", path)
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: torch.device("cpu"))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        parallel_state.initialize_model_parallel(1, 1)
        for name, overrides in check.cases().items():
            for dtype in (torch.float32, torch.bfloat16):
                assert check.run_case(mg, name, overrides, dtype, False, "reference", "cpu",
                                      dispatcher="allgather"), (name, dtype)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def test_choose_backend():
    x, ids = torch.randn(4, H), torch.zeros(4, 2, dtype=torch.int64)
    gu, dn = torch.randn(E, 2 * I, H), torch.randn(E, H, I)
    assert mg.choose_backend("auto", x, ids, gu, dn, "swiglu") == "torch"      # CPU input: the portable backend
    assert mg.choose_backend("auto", x, ids, gu, dn, "swiglu", ep_size=2) == "torch"
    with pytest.raises(RuntimeError, match="expert parallelism runs on the portable backend"):
        mg.choose_backend("cuda", x, ids, gu, dn, "swiglu", ep_size=2)
    assert mg.choose_backend("reference", x, ids, gu, dn, "swiglu") == "reference"
    with pytest.raises(RuntimeError, match="need a CUDA device"):
        mg.choose_backend("cuda", x, ids, gu, dn, "swiglu")
    with pytest.raises(ValueError, match="mok_backend must be"):
        mg.choose_backend("fast", x, ids, gu, dn, "swiglu")


def test_choose_backend_falls_back_without_kernel_library(monkeypatch):
    """Supported inputs but no loadable kernel library: "auto" falls back to the
    portable backend (as the layer and mok_nn.ops do), "cuda" raises naming the library."""
    from mok_nn import cuda_backend

    def no_library():
        raise OSError("no kernel library here")

    monkeypatch.setattr(cuda_backend, "check_supported", lambda *args: None)
    monkeypatch.setattr(cuda_backend, "_lib", no_library)
    x = SimpleNamespace(is_cuda=True)  # stands for a CUDA tensor: only is_cuda is read here
    assert mg.choose_backend("auto", x, None, None, None, "swiglu") == "torch"
    with pytest.raises(RuntimeError, match="mok_backend='cuda'.*kernel library"):
        mg.choose_backend("cuda", x, None, None, None, "swiglu")


def test_shared_expert_half_missing_raises():
    """mok_to_megatron_state_dict: a shared expert with gate_proj but no up_proj (or the reverse) cannot make
    Megatron's linear_fc1; it raised a bare KeyError, now a ValueError naming the half it has."""
    cfg = CONFIGS["deepseek_v3_like"]
    mok = mg.megatron_to_mok_state_dict({"p." + k: v for k, v in _megatron_state_dict(cfg, "grouped").items()}, "p.")
    assert "shared_expert.up_proj.weight" in mok
    for gone, kept in (("shared_expert.up_proj.weight", "gate_proj"), ("shared_expert.gate_proj.weight", "up_proj")):
        with pytest.raises(ValueError, match=kept):
            mg.mok_to_megatron_state_dict({k: v for k, v in mok.items() if k != gone}, "p.", "grouped")
