"""Qwen3-MoE: Qwen3's decoder with mixture-of-experts MLPs (no shared expert) except where transformers' rule
keeps a dense one."""
from __future__ import annotations

import re

import torch
from torch import nn
from transformers import PretrainedConfig

from nanovllm.layers.fused_moe import FusedMoE
from nanovllm.layers.linear import ReplicatedLinear
from nanovllm.models.llama import DecoderMLP, DecoderOptions, LlamaForCausalLM, check_silu

# the experts' checkpoint tensors: one per expert and projection (the Hub's), or packed per layer
_PER_EXPERT = re.compile(r"(.*\.experts\.)(\d+)\.(gate_proj|up_proj|down_proj)\.weight(_scale_inv)?")
_PACKED = re.compile(r"(.*\.experts\.)(gate_up_proj|down_proj)")
_SHARDS = {"gate_proj": ("w13_weight", "w1"), "up_proj": ("w13_weight", "w3"), "down_proj": ("w2_weight", "w2"),
           "gate_up_proj": ("w13_weight", "w13")}


class Qwen3MoeSparseMoeBlock(nn.Module):
    def __init__(self, config: PretrainedConfig):
        super().__init__()
        check_silu(config)
        self.gate = ReplicatedLinear(config.hidden_size, config.num_experts, bias=False)
        self.experts = FusedMoE(config.num_experts, config.num_experts_per_tok, config.hidden_size,
                                config.moe_intermediate_size, renormalize=config.norm_topk_prob)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.gate(x), residual)


def is_sparse_layer(config: PretrainedConfig, layer_idx: int) -> bool:
    """transformers' rule: unless mlp_only_layers lists it, every decoder_sparse_step-th layer."""
    return (layer_idx not in (getattr(config, "mlp_only_layers", None) or []) and getattr(config, "num_experts", 0) > 0
            and (layer_idx + 1) % getattr(config, "decoder_sparse_step", 1) == 0)


def qwen3_moe_mlp(config: PretrainedConfig, options: DecoderOptions, layer_idx: int) -> nn.Module:
    return Qwen3MoeSparseMoeBlock(config) if is_sparse_layer(config, layer_idx) else DecoderMLP(config, options)


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    @staticmethod
    def options(config: PretrainedConfig) -> DecoderOptions:
        bias = getattr(config, "attention_bias", False)
        return DecoderOptions(qkv_bias=bias, o_bias=bias, qk_norm=True, mlp=qwen3_moe_mlp)

    @staticmethod
    def check_config(config: PretrainedConfig, max_model_len: int):
        LlamaForCausalLM.check_config(config, max_model_len)
        experts, top_k = getattr(config, "num_experts", 0), getattr(config, "num_experts_per_tok", 0)
        if experts > 0 and not 0 < top_k <= experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be in [1, num_experts={experts}]")
        step = getattr(config, "decoder_sparse_step", 1)
        if isinstance(step, bool) or not isinstance(step, int) or step < 1:
            raise ValueError(f"decoder_sparse_step must be a positive int, got {step!r}")

    @staticmethod
    def checkpoint_target(name: str) -> tuple[str, tuple] | None:
        """(parameter, weight_loader's arguments) of an expert's checkpoint tensor, else None."""
        if match := _PER_EXPERT.fullmatch(name):
            param, shard = _SHARDS[match[3]]
            return match[1] + param + (match[4] or ""), (int(match[2]), shard)
        if match := _PACKED.fullmatch(name):
            param, shard = _SHARDS[match[2]]
            return match[1] + param, (None, shard)
        return None
