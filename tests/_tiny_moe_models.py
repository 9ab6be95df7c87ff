"""Tiny random transformers MoE models built from configs (no downloads) for the
integration tests; the same configs work with transformers 4.57 and 5.x."""

import torch

VOCAB = 64
_COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
               max_position_embeddings=64, tie_word_embeddings=False)

# name -> (config class, causal-LM class, config kwargs)
ARCHS = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(intermediate_size=16, num_local_experts=8, num_experts_per_tok=2,
                     num_key_value_heads=2, output_router_logits=False)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(intermediate_size=48, moe_intermediate_size=16, shared_expert_intermediate_size=24,
                       num_experts=8, num_experts_per_tok=2, norm_topk_prob=False, num_key_value_heads=2)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(intermediate_size=48, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=3,
                       norm_topk_prob=True, head_dim=8, num_key_value_heads=2)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM",
              dict(intermediate_size=16, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False,
                   eos_token_id=1, pad_token_id=0, num_key_value_heads=2)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(intermediate_size=48, moe_intermediate_size=16, n_routed_experts=8,
                         num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1,
                         first_k_dense_replace=1, num_hidden_layers=3, routed_scaling_factor=2.5,
                         q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                         v_head_dim=8, num_key_value_heads=4)),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                dict(intermediate_size=16, num_local_experts=8, num_experts_per_tok=2, head_dim=8,
                     sliding_window=8, num_key_value_heads=2, swiglu_limit=1.5)),
}


def build(arch: str, seed: int = 0, dtype=torch.float32, **overrides):
    """A tiny random model of `arch`, with every routing-relevant tensor random
    (biases and DeepSeek's e_score_correction_bias are zero after init)."""
    import transformers

    cfg_name, model_name, kw = ARCHS[arch]
    config = getattr(transformers, cfg_name)(**{**_COMMON, **kw, **overrides})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config)
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("e_score_correction_bias"):
                t.copy_(torch.rand_like(t) * 0.3)
            elif name.endswith("bias") and t.abs().max() == 0:
                t.normal_(0, 0.2)
            elif name.endswith("gate.weight") and t.shape[0] == 1:   # Qwen2 shared-expert gate
                t.normal_(0, 0.5)
            elif "router" in name or name.endswith("mlp.gate.weight"):
                t.normal_(0, 0.5)   # spread router logits so top-k has no near-ties
    return model.to(dtype).eval()
