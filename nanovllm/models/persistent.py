"""A dense decoder's decode step through the persistent kernel (``kernels/triton_decode``): the embedding, one launch
for every layer, the final norm. ``DecodeGraphs`` captures it in place of the model for small batches."""
from __future__ import annotations

import torch
from torch import nn

from nanovllm.kernels.decode_plan import BLOCK_M, DecodePlan
from nanovllm.models.llama import DecoderMLP, DecoderModel
from nanovllm.utils.context import get_context


def unsupported(model: nn.Module, kv_cache: torch.Tensor, tp_size: int) -> list[str]:
    """Why the persistent kernel cannot run this model's decode step (empty: it can)."""
    decoder = getattr(model, "model", None)
    if not isinstance(decoder, DecoderModel):
        return [f"{type(model).__name__} is not a dense decoder"]
    reasons = [] if tp_size == 1 else [f"tensor_parallel_size {tp_size}"]
    layer = decoder.layers[0]
    attn = layer.self_attn
    if not all(isinstance(x.mlp, DecoderMLP) for x in decoder.layers):
        reasons.append("a mixture of experts")
    if attn.o_proj.bias is not None or layer.mlp.gate_up_proj.bias is not None:
        reasons.append("o_proj or MLP biases")
    if kv_cache.dtype != attn.qkv_proj.weight.dtype:
        reasons.append(f"kv_cache_dtype {kv_cache.dtype}")
    if len({x.self_attn.attn.sliding_window for x in decoder.layers}) > 1:
        reasons.append("sliding windows on some layers only")
    if attn.head_dim not in (64, 128):
        reasons.append(f"head_dim {attn.head_dim}")
    if not kv_cache.is_cuda:
        reasons.append("not on CUDA")
    return reasons


class PersistentDecoder:
    """Holds the kernel's plan, scratch buffers and the table of each layer's weight pointers (the parameters'
    storage: weights copied into place stay seen)."""

    def __init__(self, model: nn.Module, kv_cache: torch.Tensor, num_programs: int, **options):
        from nanovllm.kernels.triton_decode import TABLE, DecodeScratch
        self.model, self.kv_cache, self.options = model, kv_cache, options
        decoder: DecoderModel = model.model
        attn, mlp = decoder.layers[0].self_attn, decoder.layers[0].mlp
        hidden = decoder.norm.weight.numel()
        self.plan = DecodePlan.build(hidden, attn.num_heads, attn.num_kv_heads, attn.head_dim,
                                     mlp.down_proj.weight.size(1), num_programs)
        weight = attn.qkv_proj.weight
        self.scratch = DecodeScratch(self.plan, weight.dtype, weight.device)
        self.qk_norm, self.qkv_bias = hasattr(attn, "q_norm"), attn.qkv_proj.bias is not None
        self.eps = decoder.layers[0].input_layernorm.eps
        if self.qk_norm and attn.q_norm.eps != self.eps:
            raise ValueError(f"q_norm's eps {attn.q_norm.eps} differs from the layers' {self.eps}")
        rows = []
        for layer in decoder.layers:
            a, m = layer.self_attn, layer.mlp
            params = dict(input_layernorm=layer.input_layernorm.weight, qkv_proj=a.qkv_proj.weight,
                          qkv_bias=a.qkv_proj.bias, q_norm=getattr(a, "q_norm", None),
                          k_norm=getattr(a, "k_norm", None), o_proj=a.o_proj.weight,
                          post_attention_layernorm=layer.post_attention_layernorm.weight,
                          gate_up_proj=m.gate_up_proj.weight, down_proj=m.down_proj.weight)
            params["q_norm"] = params["q_norm"].weight if params["q_norm"] is not None else None
            params["k_norm"] = params["k_norm"].weight if params["k_norm"] is not None else None
            rows.append([0 if params[name] is None else params[name].data_ptr() for name in TABLE])
        self.table = torch.tensor(rows, dtype=torch.int64, device=weight.device)
        self.attn = attn.attn

    @property
    def max_batch_size(self) -> int:
        return BLOCK_M

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The final hidden states [bs, hidden] of a decode step (``model(input_ids, positions)``'s)."""
        from nanovllm.kernels.triton_decode import decode_layers
        decoder: DecoderModel = self.model.model
        ctx = get_context()
        r = decoder.embed_tokens(input_ids)
        decode_layers(self.plan, self.scratch, r, self.table, self.kv_cache, decoder.rotary_emb.cos_sin_cache,
                      positions, ctx.slot_mapping, ctx.context_lens, ctx.block_tables, eps=self.eps,
                      scale=self.attn.scale, window=self.attn.sliding_window, qk_norm=self.qk_norm,
                      qkv_bias=self.qkv_bias, **self.options)
        return decoder.norm(r)
