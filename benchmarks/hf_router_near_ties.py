"""How often a bf16 transformers model patched with patch_model picks other experts
than the original model (near ties broken the other way by fp32 router logits),
with the default router_dtype=None and with router_dtype="model", and how many of
those tokens have an exact tie at the k-th place of the selection scores (there
mok_nn takes the lower expert index; torch.topk, which the original routers use,
promises no order).

Models are built from configs (random weights, transformers' own init; no
downloads). Each MoE block's router sees the inputs the original model gave
that block; a token counts as different when its set of chosen experts differs.

    PYTHONPATH=$PWD python benchmarks/hf_router_near_ties.py [--tokens 4096]
"""

import argparse
import copy

import torch
import transformers

from mok_nn import router as routing
from mok_nn.integrations.huggingface import MoKHFBlock, SUPPORTED_BLOCKS, patch_model

COMMON = dict(vocab_size=1024, hidden_size=512, num_hidden_layers=4, num_attention_heads=8,
              num_key_value_heads=4, max_position_embeddings=4096, tie_word_embeddings=False)
ARCHS = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(intermediate_size=256, num_local_experts=8,
                                                             num_experts_per_tok=2)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(intermediate_size=512, moe_intermediate_size=128,
                                                                 num_experts=64, num_experts_per_tok=8,
                                                                 norm_topk_prob=True, head_dim=64)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(intermediate_size=128, num_experts=64, num_experts_per_tok=8,
                                                       norm_topk_prob=False)),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(intermediate_size=128, num_local_experts=32,
                                                           num_experts_per_tok=4, head_dim=64, sliding_window=128)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(intermediate_size=512, moe_intermediate_size=128, n_routed_experts=64,
                         num_experts_per_tok=8, n_group=8, topk_group=4, n_shared_experts=1,
                         first_k_dense_replace=1, q_lora_rank=64, kv_lora_rank=64, qk_rope_head_dim=32,
                         qk_nope_head_dim=32, v_head_dim=32, num_key_value_heads=8)),
}


def build(arch, seed):
    cfg_name, model_name, kw = ARCHS[arch]
    config = getattr(transformers, cfg_name)(**{**COMMON, **kw})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return getattr(transformers, model_name)(config).to(torch.bfloat16).eval()


def block_inputs(model, ids):
    """{block name: the hidden states the original model passes that MoE block}."""
    seen, hooks = {}, []
    for name, module in model.named_modules():
        if type(module).__name__ in SUPPORTED_BLOCKS:
            hooks.append(module.register_forward_pre_hook(
                lambda m, args, name=name: seen.__setitem__(name, args[0].detach())))
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    return seen


def original_ids(block, x):
    router = getattr(block, "gate", None) or block.router
    with torch.no_grad():
        return router(x.reshape(-1, x.shape[-1]))[2]


def mok_routing(block: MoKHFBlock, x):
    """(chosen expert ids, whether the k-th and (k+1)-th selection scores tie exactly)."""
    layer = block.mok
    with torch.no_grad():
        logits = layer.router(x.reshape(-1, x.shape[-1]).to(layer.router.weight.dtype))
        ids, _, scores = routing.route(logits, layer.top_k, layer.score_func, layer.norm_topk_prob, layer.n_group,
                                       layer.topk_group, layer.routed_scaling_factor,
                                       layer.router.e_score_correction_bias)
        bias = layer.router.e_score_correction_bias
        choice = (scores if bias is None else scores + bias).sort(dim=-1, descending=True).values
        return ids, choice[:, layer.top_k - 1] == choice[:, layer.top_k]


def differing(a, b):
    return (a.sort(dim=-1).values != b.sort(dim=-1).values).any(dim=-1)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per model (batch of 512-token sequences)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, bf16, {args.tokens} tokens, "
          "tokens whose chosen experts differ from the original model's, summed over MoE blocks")
    print(f"{'model':<12} {'blocks':>6} {'experts':>8} {'router_dtype=None':>30} {'router_dtype=model':>30}")
    for arch in ARCHS:
        model = build(arch, args.seed)
        g = torch.Generator().manual_seed(args.seed + 1)
        ids = torch.randint(0, COMMON["vocab_size"], (max(1, args.tokens // 512), min(512, args.tokens)), generator=g)
        inputs = block_inputs(model, ids)
        counts = {}
        for mode in (None, "model"):
            patched = patch_model(copy.deepcopy(model), router_dtype=mode, backend="reference")
            diff = tied = total = 0
            for name, x in inputs.items():
                want = original_ids(model.get_submodule(name), x)
                got, tie = mok_routing(patched.get_submodule(name), x)
                differ = differing(got, want)
                diff += int(differ.sum())
                tied += int((differ & tie).sum())
                total += want.shape[0]
            counts[mode] = f"{diff}/{total} ({100 * diff / total:.2f}%), {tied} tied"
        experts = f"{want.shape[1]} of {patched.get_submodule(name).mok.num_experts}"
        print(f"{arch:<12} {len(inputs):>6} {experts:>8} {counts[None]:>30} {counts['model']:>30}")


if __name__ == "__main__":
    main()
