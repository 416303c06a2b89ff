"""EAGLE-3 draft heads for speculative decoding (``speculative_config={"method": "eagle3", "model":
PATH, ...}``), in the layout of their public checkpoints (Llama-3.1-8B's and Qwen3-8B's): ``fc``
fuses the target's hidden states at three layers (the residual stream entering them), one decoder
layer (``midlayer``) attends over the embedding of the next token beside that fused state, and an
LM head over a draft vocabulary whose ids map to the target's through ``d2t`` (target id = draft id
+ ``d2t[draft id]``). The embedding is the checkpoint's or, absent there, the target's.

Position ``p`` of the draft reads token ``p + 1`` and the target's state at ``p``, and predicts
token ``p + 2``; its K/V lives in the target's blocks (its layer of the cache), rewritten from the
target's states whenever the target computes ``p``. After every forward of the target (prefill,
decode or verify) the head runs over the positions just computed whose next token is known, which
gives the first proposal; the others come from its own states, one position each, at the next
step's proposal."""
from __future__ import annotations

import json
import os

import torch
from safetensors import safe_open
from torch import nn

from nanovllm.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.linear import QKVParallelLinear, ReplicatedLinear
from nanovllm.layers.rotary_embedding import get_rope
from nanovllm.models.llama import (
    DecoderAttention,
    DecoderMLP,
    DecoderOptions,
    LlamaForCausalLM,
    head_dim_of,
)
from nanovllm.utils.loader import checkpoint_files, load_model

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


class Eagle3Layer(nn.Module):
    """The draft's decoder layer: q/k/v over [norm(embedding), norm(state)], the residual the
    state (or its norm, with ``norm_before_residual``)."""

    def __init__(self, config, rotary):
        super().__init__()
        hidden = config.hidden_size
        bias = getattr(config, "attention_bias", False)
        options = DecoderOptions(qkv_bias=bias, o_bias=bias)
        self.self_attn = DecoderAttention(config, options, rotary)
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        self.self_attn.qkv_proj = QKVParallelLinear(2 * hidden, head_dim_of(config), heads,
                                                    kv_heads, bias=bias)
        self.mlp = DecoderMLP(config, DecoderOptions(mlp_bias=getattr(config, "mlp_bias", False)))
        self.input_layernorm = RMSNorm(hidden, eps=config.rms_norm_eps)
        self.hidden_norm = RMSNorm(hidden, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps=config.rms_norm_eps)
        self.norm_before_residual = getattr(config, "norm_before_residual", False)

    def forward(self, positions, embeds, states):
        normed = self.hidden_norm(states)
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        residual = self.self_attn(positions, x, normed if self.norm_before_residual else states)
        return self.mlp(self.post_attention_layernorm(residual), residual)


class Eagle3Head(nn.Module):
    """``fc``, ``midlayer``, ``norm``, ``lm_head``, ``d2t`` (and ``t2d``, kept as loaded)."""

    packed_modules_mapping = LlamaForCausalLM.packed_modules_mapping  # q/k/v, gate/up

    def __init__(self, config, target_hidden: int, max_model_len: int, own_embedding: bool):
        super().__init__()
        hidden, vocab = config.hidden_size, config.vocab_size
        draft_vocab = getattr(config, "draft_vocab_size", None) or vocab
        self.fc = ReplicatedLinear(3 * target_hidden, hidden)
        self.midlayer = Eagle3Layer(config, get_rope(head_dim_of(config), max_model_len, config))
        self.norm = RMSNorm(hidden, eps=config.rms_norm_eps)
        self.lm_head = ParallelLMHead(draft_vocab, hidden)
        self.d2t = nn.Parameter(torch.zeros(draft_vocab, dtype=torch.int64), requires_grad=False)
        self.t2d = nn.Parameter(torch.zeros(vocab, dtype=torch.bool), requires_grad=False)
        self.embed_tokens = VocabParallelEmbedding(vocab, hidden) if own_embedding else None
        self.target_embed = None  # without its own: the target's (set by ``build_eagle3``)

    def forward(self, input_ids, positions, states):
        """The pre-norm output (the next position's state) of each row."""
        embed = self.embed_tokens if self.embed_tokens is not None else self.target_embed
        return self.midlayer(positions, embed(input_ids), states)

    def logits(self, prenorm: torch.Tensor) -> torch.Tensor:
        """The target-vocabulary logits of the rows the LM head projects (-inf off the draft's)."""
        draft = self.lm_head(self.norm(prenorm)).float()
        if draft.size(1) == self.t2d.numel() and not self.d2t.any():
            return draft
        out = draft.new_full((draft.size(0), self.t2d.numel()), float("-inf"))
        out[:, torch.arange(draft.size(1), device=draft.device) + self.d2t] = draft
        return out


def aux_layers(config, num_target_layers: int) -> list[int]:
    """The target layers whose input states the head fuses: the checkpoint's, else vLLM's choice
    (2, L // 2, L - 3)."""
    eagle = getattr(config, "eagle_config", None) or {}
    ids = eagle.get("eagle_aux_hidden_state_layer_ids") if isinstance(eagle, dict) else None
    ids = list(ids) if ids else [2, num_target_layers // 2, num_target_layers - 3]
    if len(ids) != 3 or not all(isinstance(i, int) and 0 <= i < num_target_layers for i in ids):
        raise ValueError(f"EAGLE-3 needs three target layers in [0, {num_target_layers}), "
                         f"got {ids}")
    return ids


def eagle3_config(path: str):
    """The head's config (a ``LlamaConfig``); refused by name if it is not an EAGLE-3 head."""
    with open(os.path.join(path, "config.json")) as f:
        fields = json.load(f)
    if not set(fields.get("architectures") or []) & set(ARCHITECTURES):
        raise ValueError(f"speculative_config model {path!r} is not an EAGLE-3 head "
                         f"(architectures {fields.get('architectures')}; one of {ARCHITECTURES})")
    from transformers import LlamaConfig
    return LlamaConfig(**{k: v for k, v in fields.items() if k != "architectures"})


def build_eagle3(config, model: nn.Module, path: str, hf) -> tuple[Eagle3Head, list[int]]:
    """The head of config ``hf`` (``eagle3_config``) on the runner's device, loaded."""
    target = config.hf_config
    names = set()
    for file in checkpoint_files(path):
        with safe_open(file, "pt", "cpu") as f:
            names.update(f.keys())
    target_hidden = getattr(hf, "target_hidden_size", None) or target.hidden_size
    head = Eagle3Head(hf, target_hidden, config.max_model_len, "embed_tokens.weight" in names)
    load_model(head, path)
    if head.embed_tokens is None:  # the target's, not registered (not the head's to load)
        object.__setattr__(head, "target_embed", model.model.embed_tokens)
    return head, aux_layers(hf, target.num_hidden_layers)


class AuxStates:
    """The target's states entering three layers, copied by forward pre-hooks into one buffer
    [rows, 3 x hidden] (a copy CUDA graphs capture too); rows past the buffer are not kept."""

    def __init__(self, model: nn.Module, layers: list[int], rows: int, hidden: int):
        self.buffer = torch.zeros(rows, 3, hidden)
        for slot, i in enumerate(layers):
            model.model.layers[i].register_forward_pre_hook(self._hook(slot))

    def _hook(self, slot: int):
        def copy(module, args):
            states = args[1]
            n = min(states.size(0), self.buffer.size(0))
            self.buffer[:n, slot].copy_(states[:n])
        return copy

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        return self.buffer[index].flatten(1)
