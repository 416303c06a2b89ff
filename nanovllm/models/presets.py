"""Real models' config.json values and random weights, so that benchmarks run without a checkpoint
(``load_format="dummy"``). The config classes are named, not imported: transformers' LlamaConfig
module alone imports some 650 modules (sympy among them, over half a second), which every
``LLM(...)`` would pay when it looks a model name up here."""
from __future__ import annotations

import torch
import transformers
from torch import nn
from transformers import PretrainedConfig

_QWEN = dict(rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, rms_norm_eps=1e-6,
             bos_token_id=151643, eos_token_id=151645, dtype="bfloat16")
_QWEN3 = dict(_QWEN, architectures=["Qwen3ForCausalLM"], vocab_size=151936, num_key_value_heads=8,
              head_dim=128, max_position_embeddings=40960, attention_bias=False)
_LLAMA3 = dict(architectures=["LlamaForCausalLM"], vocab_size=128256, num_key_value_heads=8,
               max_position_embeddings=131072, rms_norm_eps=1e-5, bos_token_id=128000,
               eos_token_id=[128001, 128008, 128009], dtype="bfloat16")
_LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

PRESETS: dict[str, tuple[str, dict]] = {  # name: (transformers' config class, its fields)
    "qwen3-0.6b": ("Qwen3Config", dict(_QWEN3, hidden_size=1024, intermediate_size=3072,
                                       num_hidden_layers=28, num_attention_heads=16,
                                       tie_word_embeddings=True)),
    "qwen3-8b": ("Qwen3Config", dict(_QWEN3, hidden_size=4096, intermediate_size=12288,
                                     num_hidden_layers=36, num_attention_heads=32,
                                     tie_word_embeddings=False)),
    "llama-3.2-1b": ("LlamaConfig", dict(_LLAMA3, hidden_size=2048, intermediate_size=8192,
                                         num_hidden_layers=16, num_attention_heads=32, head_dim=64,
                                         tie_word_embeddings=True,
                                         rope_parameters=dict(_LLAMA3_ROPE, factor=32.0))),
    "llama-3.1-8b": ("LlamaConfig", dict(_LLAMA3, hidden_size=4096, intermediate_size=14336,
                                         num_hidden_layers=32, num_attention_heads=32, head_dim=128,
                                         tie_word_embeddings=False,
                                         rope_parameters=dict(_LLAMA3_ROPE, factor=8.0))),
    "qwen2.5-7b": ("Qwen2Config", dict(_QWEN, architectures=["Qwen2ForCausalLM"], vocab_size=152064,
                                       hidden_size=3584, intermediate_size=18944,
                                       num_hidden_layers=28, num_attention_heads=28,
                                       num_key_value_heads=4, max_position_embeddings=32768,
                                       tie_word_embeddings=False, use_sliding_window=False)),
    # intermediate_size: the unused dense MLP's
    "qwen3-30b-a3b": ("Qwen3MoeConfig", dict(_QWEN3, architectures=["Qwen3MoeForCausalLM"],
                                             num_key_value_heads=4, hidden_size=2048,
                                             intermediate_size=6144, num_hidden_layers=48,
                                             num_attention_heads=32, tie_word_embeddings=False,
                                             num_experts=128, num_experts_per_tok=8,
                                             moe_intermediate_size=768, norm_topk_prob=True,
                                             decoder_sparse_step=1, mlp_only_layers=[],
                                             use_sliding_window=False)),
}
# Qwen's own fp8 checkpoints (Qwen3-*-FP8): the same models, e4m3 weights with a scale per
# 128x128 block
_FP8 = dict(quantization_config={"quant_method": "fp8", "fmt": "e4m3",
                                 "activation_scheme": "dynamic", "weight_block_size": [128, 128]})
PRESETS.update({f"{name}-fp8": (cls, dict(fields, **_FP8))
                for name, (cls, fields) in list(PRESETS.items()) if name.startswith("qwen3-")})


def preset_config(name: str) -> PretrainedConfig:
    config_class, fields = PRESETS[name]
    return getattr(transformers, config_class)(**fields)


@torch.no_grad()
def load_dummy_weights(model: nn.Module, seed: int = 0):
    """N(0, 0.02) weights and biases, unit norm weights and fp8 block scales; parameters marked
    ``replicated_rank`` (a MoE router) get rank 0's values on every rank (``seed`` is the engine's
    plus the rank)."""
    device = next(model.parameters()).device
    generator = torch.Generator(device).manual_seed(seed)
    replicated: torch.Generator | None = None  # one stream for all of them, in order
    for name, param in model.named_parameters():
        if name.endswith(("norm.weight", "weight_scale_inv")):
            param.fill_(1.0)
        elif param.dtype == torch.float8_e4m3fn:  # no random kernels for fp8
            param.copy_(torch.empty(param.shape, device=device)
                        .normal_(0.0, 0.02, generator=generator))
        elif hasattr(param, "replicated_rank"):
            if replicated is None:
                replicated = torch.Generator(device).manual_seed(seed - param.replicated_rank)
            param.normal_(0.0, 0.02, generator=replicated)
        else:
            param.normal_(0.0, 0.02, generator=generator)
