"""The tensor-parallel Llama decoder and the dense families sharing it: Llama, Mistral, Qwen2/3."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PretrainedConfig

from nanovllm.layers.attention import Attention
from nanovllm.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from nanovllm.layers.rotary_embedding import RotaryEmbedding, get_rope, rope_parameters
from nanovllm.plugins import REGISTRY
from nanovllm.utils.context import get_context


def check_silu(config: PretrainedConfig):
    if config.hidden_act != "silu":
        raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (only 'silu')")


def head_dim_of(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def sliding_windows(config: PretrainedConfig) -> list[int]:
    """Each layer's sliding window (0: none), read as transformers reads it."""
    window, n = getattr(config, "sliding_window", None) or 0, config.num_hidden_layers
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ValueError(f"the model's sliding_window must be a positive int, got {window!r}")
    if (types := getattr(config, "layer_types", None)) is not None:
        unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
        if unknown or len(types) != n:
            raise ValueError(f"layer_types {unknown or types} are not supported (one of "
                             f"'full_attention', 'sliding_attention' per layer)")
        return [window if t == "sliding_attention" else 0 for t in types]
    if not getattr(config, "use_sliding_window", True):
        return [0] * n
    qwen = config.model_type in ("qwen2", "qwen3")
    first = (getattr(config, "max_window_layers", 0) or 0) if qwen else 0
    return [window if i >= first else 0 for i in range(n)]


@dataclass(frozen=True)
class DecoderOptions:
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    # (config, options, layer i) -> layer i's MLP if not DecoderMLP; forward(x, residual) adds to it
    mlp: Callable[[PretrainedConfig, DecoderOptions, int], nn.Module] | None = None


class DecoderAttention(nn.Module):
    def __init__(self, config: PretrainedConfig, options: DecoderOptions,
                 rotary_emb: RotaryEmbedding, sliding_window: int = 0):
        super().__init__()
        self.head_dim = head_dim = head_dim_of(config)
        hidden, heads = config.hidden_size, config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        self.qkv_proj = QKVParallelLinear(hidden, head_dim, heads, kv_heads, bias=options.qkv_bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(heads * head_dim, hidden, bias=options.o_bias)
        self.rotary_emb = rotary_emb  # shared by every layer
        self.attn = Attention(self.num_heads, head_dim, head_dim ** -0.5, self.num_kv_heads,
                              sliding_window)
        if options.qk_norm:  # Qwen3: RMSNorm over each head of q and k, before rotary
            self.q_norm = RMSNorm(head_dim, eps=config.rms_norm_eps)
            self.k_norm = RMSNorm(head_dim, eps=config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor) -> torch.Tensor:  # residual + the attention block
        qkv = self.qkv_proj(hidden_states)
        norm, attn, fused = hasattr(self, "q_norm"), self.attn, self.attn.backend.qk_norm_rope_store
        if fused is not None and self.head_dim & (self.head_dim - 1) == 0:  # norm, rotary, KV store
            o = attn(*fused(
                qkv, positions, self.rotary_emb.cos_sin_cache, self.q_norm.weight if norm else None,
                self.k_norm.weight if norm else None, self.q_norm.eps if norm else 0.0,
                attn.k_cache, attn.v_cache, get_context().slot_mapping, self.num_heads,
                self.num_kv_heads, self.head_dim, attn.k_scale, attn.v_scale), kv_stored=True)
            return self.o_proj(o.flatten(1, -1), residual)
        q, k, v = qkv.view(-1, self.num_heads + 2 * self.num_kv_heads, self.head_dim).split(
            [self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)
        if norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return self.o_proj(attn(*self.rotary_emb(positions, q, k), v).flatten(1, -1), residual)


class DecoderMLP(nn.Module):
    def __init__(self, config: PretrainedConfig, options: DecoderOptions):
        super().__init__()
        check_silu(config)
        hidden, inter = config.hidden_size, config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [inter] * 2, bias=options.mlp_bias)
        self.down_proj = RowParallelLinear(inter, hidden, bias=options.mlp_bias)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:  # residual + MLP(x)
        return self.down_proj(self.gate_up_proj(x, silu_mul=True), residual)


class DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, options: DecoderOptions,
                 rotary_emb: RotaryEmbedding, layer_idx: int = 0, sliding_window: int = 0):
        super().__init__()
        self.self_attn = DecoderAttention(config, options, rotary_emb, sliding_window)
        self.mlp = (options.mlp(config, options, layer_idx) if options.mlp
                    else DecoderMLP(config, options))
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        residual = self.self_attn(positions, self.input_layernorm(hidden_states), hidden_states)
        return self.mlp(self.post_attention_layernorm(residual), residual)


class DecoderModel(nn.Module):
    def __init__(self, config: PretrainedConfig, options: DecoderOptions, max_model_len: int):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.rotary_emb = get_rope(head_dim_of(config), max_model_len, config)
        self.layers = nn.ModuleList([  # a window of max_model_len or more hides nothing
            DecoderLayer(config, options, self.rotary_emb, i, w if w < max_model_len else 0)
            for i, w in enumerate(sliding_windows(config))])
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        for layer in self.layers:
            hidden_states = layer(positions, hidden_states)
        return self.norm(hidden_states)


class LlamaForCausalLM(nn.Module):
    packed_modules_mapping = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"),
                              "v_proj": ("qkv_proj", "v"), "gate_proj": ("gate_up_proj", 0),
                              "up_proj": ("gate_up_proj", 1)}

    @staticmethod
    def options(config: PretrainedConfig) -> DecoderOptions:
        bias = getattr(config, "attention_bias", False)
        return DecoderOptions(qkv_bias=bias, o_bias=bias,
                              mlp_bias=getattr(config, "mlp_bias", False))

    @staticmethod
    def check_config(config: PretrainedConfig, max_model_len: int):  # refuses before any loading
        sliding_windows(config)
        rope_parameters(config)

    head_dim = staticmethod(head_dim_of)

    @staticmethod
    def sharded_sizes(config: PretrainedConfig) -> dict[str, int | None]:
        heads = config.num_attention_heads
        return {"num_attention_heads": heads,
                "num_key_value_heads": getattr(config, "num_key_value_heads", None) or heads,
                "intermediate_size": getattr(config, "intermediate_size", None)}

    def __init__(self, config: PretrainedConfig, max_model_len: int | None = None):
        super().__init__()
        max_len = config.max_position_embeddings if max_model_len is None else max_model_len
        if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1:
            raise ValueError(f"max_model_len must be a positive int, got {max_len!r}")
        self.model = DecoderModel(config, self.options(config), max_len)
        tied = self.model.embed_tokens.weight if config.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tied)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.lm_head(hidden_states)


class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def options(config: PretrainedConfig) -> DecoderOptions:
        return DecoderOptions(qkv_bias=True)


class Qwen3ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def options(config: PretrainedConfig) -> DecoderOptions:
        bias = getattr(config, "attention_bias", False)
        return DecoderOptions(qkv_bias=bias, o_bias=bias, qk_norm=True)


class MistralForCausalLM(LlamaForCausalLM):
    """Llama's options; ``sliding_window`` (when set) on every layer."""


for _cls in (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM):
    REGISTRY.register("model", _cls.__name__, f"{_cls.__module__}:{_cls.__name__}")
