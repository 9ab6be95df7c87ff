"""Compare a real Megatron-core MoE layer with the mok_nn-patched one (GPU).

Builds Megatron-core's MoELayer from its own module spec (local SequentialMLP
experts, and TEGroupedMLP when Transformer Engine is installed), builds
MoKMegatronMoELayer from the same spec, copies the state dict across (same
keys), and compares outputs, input gradients and every parameter gradient
(aux and z losses included, they flow through Megatron's router in both).

    torchrun --nproc-per-node 1 examples/megatron_check.py      # or plain python: NCCL world of 1
    python examples/megatron_check.py --backend reference --dtype float32

Needs CUDA and megatron-core 0.19.  megatron-core 0.19 declares Python >= 3.12;
on Python 3.11 its wheel can be unpacked (python -m zipfile -e WHEEL DIR) and
put on PYTHONPATH (pass --megatron-path DIR); it imports fine (it needs triton,
which CUDA builds of torch bring).  Exit status 0 when every case agrees.
"""

import argparse
import math
import os
import sys

import torch
import torch.nn.functional as F

def import_megatron_integration():
    from mok_nn.integrations import megatron as mg
    return mg


def cases():
    from megatron.core.fusions.fused_bias_geglu import quick_gelu

    return {
        # Mixtral / Qwen3-like: softmax top-k, aux + z loss
        "softmax_aux_z": dict(moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3),
        # DeepSeek-V3-like: sigmoid, expert bias, group-limited, scaling, shared expert
        "sigmoid_groups_shared": dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                                      moe_router_num_groups=4, moe_router_group_topk=2,
                                      moe_router_topk_scaling_factor=2.5, moe_aux_loss_coeff=0.0,
                                      moe_shared_expert_intermediate_size=384),
        # Qwen2-MoE-like: pre-softmax, shared expert with sigmoid gate, clamped SwiGLU
        "presoftmax_gated_shared_clamp": dict(moe_router_pre_softmax=True, moe_shared_expert_intermediate_size=384,
                                              moe_shared_expert_gate=True, activation_func_clamp_value=2.0,
                                              moe_aux_loss_coeff=1e-2),
        # GPT-OSS-like: biases, quick_gelu GLU with +1 offset and clamp
        "gpt_oss_like": dict(activation_func=quick_gelu, glu_linear_offset=1.0, activation_func_clamp_value=7.0,
                             add_bias_linear=True, bias_dropout_fusion=False, moe_aux_loss_coeff=1e-2),
    }


def make_config(overrides, dtype, dispatcher):
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw = dict(num_layers=1, hidden_size=256, num_attention_heads=8, ffn_hidden_size=512, moe_ffn_hidden_size=512,
              num_moe_experts=16, moe_router_topk=4, gated_linear_unit=True, activation_func=F.silu,
              add_bias_linear=False, bias_activation_fusion=False, moe_token_dispatcher_type=dispatcher,
              moe_router_load_balancing_type="aux_loss", moe_router_dtype="fp32", params_dtype=dtype,
              bf16=dtype == torch.bfloat16, use_cpu_initialization=True)
    kw.update(overrides)
    return TransformerConfig(**kw)


@torch.no_grad()
def randomize(layer, seed):
    """Weights with std 1/sqrt(fan_in) (Megatron's default 0.02 makes the outputs tiny), random expert bias."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    for name, p in layer.named_parameters():
        fan_in = p.shape[-1] if p.dim() > 1 else 16
        p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(fan_in))
    bias = getattr(layer.router, "expert_bias", None)
    if bias is not None:
        bias.copy_(torch.rand(bias.shape, generator=g) * 0.1)


def rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


def run_case(mg, name, overrides, dtype, use_te, backend, device, dispatcher="alltoall", tokens=(64, 2)):
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

    cfg = make_config(overrides, dtype, dispatcher)
    spec = get_moe_module_spec(use_te=use_te, num_experts=cfg.num_moe_experts, moe_grouped_gemm=use_te)
    ref = spec(config=cfg).to(device)
    randomize(ref, seed=1)
    pat = mg.to_mok_moe_spec(spec, mok_backend=backend)(config=cfg).to(device)
    missing, unexpected = pat.load_state_dict(ref.state_dict(), strict=True)
    ref.train()
    pat.train()

    g = torch.Generator(device="cpu").manual_seed(2)
    x = torch.randn(*tokens, cfg.hidden_size, generator=g).to(device=device, dtype=dtype)
    dy = torch.randn(*tokens, cfg.hidden_size, generator=g).to(device=device, dtype=dtype)
    # Megatron's SequentialMLP cannot backpropagate through expert biases (an in-place add
    # on a custom Function's output in megatron/core/transformer/mlp.py): forward only there
    backward = not (cfg.add_bias_linear and not use_te)
    results = {}
    for tag, layer in (("megatron", ref), ("mok", pat)):
        xi = x.clone().requires_grad_()
        with torch.set_grad_enabled(backward):
            y, bias = layer(xi)
        assert bias is None
        if backward:
            (y.float() * dy.float()).sum().backward()
        grads = {n: p.grad for n, p in layer.named_parameters()}
        results[tag] = (y.detach(), xi.grad if backward else y.detach(), grads)

    (y_r, dx_r, g_r), (y_p, dx_p, g_p) = results["megatron"], results["mok"]
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    errors = {"y": rel(y_p, y_r), "dx": rel(dx_p, dx_r)}
    for n, gr in g_r.items():
        if gr is None:
            assert g_p[n] is None, n
            continue
        errors[n] = rel(g_p[n], gr)
    worst = max(errors, key=errors.get)
    ok = all(v <= tol for v in errors.values())
    experts = "TEGroupedMLP" if use_te else "SequentialMLP"
    print(f"{'PASS' if ok else 'FAIL'} {name:30s} {experts:13s} {str(dtype):15s} "
          f"{'' if backward else '(forward only) '}"
          f"rel err y {errors['y']:.2e}  dx {errors['dx']:.2e}  worst {worst} {errors[worst]:.2e} (tol {tol:g})")
    return ok


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="auto", choices=["auto", "reference", "cuda"])
    ap.add_argument("--dtype", default="both", choices=["float32", "bfloat16", "both"])
    ap.add_argument("--megatron-path", help="directory holding an unpacked megatron-core wheel")
    args = ap.parse_args()
    if args.megatron_path:
        sys.path.insert(0, args.megatron_path)
    if not torch.cuda.is_available():
        sys.exit("megatron_check needs a CUDA device (Megatron's MoE layer does not run on CPU)")

    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    mg = import_megatron_integration()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl", rank=int(os.environ.get("RANK", 0)), world_size=int(os.environ.get("WORLD_SIZE", 1)))
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                                             expert_model_parallel_size=1)
    model_parallel_cuda_manual_seed(0)
    try:
        import transformer_engine  # noqa: F401
        te_options = [False, True]
    except ImportError:
        te_options = [False]
        print("Transformer Engine not installed: checking SequentialMLP experts only")

    dtypes = {"float32": [torch.float32], "bfloat16": [torch.bfloat16],
              "both": [torch.float32, torch.bfloat16]}[args.dtype]
    ok = True
    for use_te in te_options:
        for dtype in dtypes:
            for name, overrides in cases().items():
                try:
                    ok &= run_case(mg, name, overrides, dtype, use_te, args.backend, "cuda")
                except Exception as err:  # report every case, then fail
                    ok = False
                    print(f"FAIL {name} use_te={use_te} {dtype}: {type(err).__name__}: {err}")
    dist.destroy_process_group()
    print("ALL PASS" if ok else "SOME CASES FAILED")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
