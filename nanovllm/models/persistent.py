"""A dense decoder's decode step through the persistent kernel (``kernels/triton_decode``): the embedding, one launch
for every layer, the final norm. ``DecodeGraphs`` captures it in place of the model for small batches. fp8 weights
(``layers/quantization``) are read as the engine's fp8 decode reads them: a checkpoint's block-wise ones with the
activations in the model's dtype, ``quantization="fp8"``'s per-channel ones with the activations quantized per
token."""
from __future__ import annotations

import torch
from torch import nn

from nanovllm.kernels.decode_plan import BLOCK_M, DecodePlan
from nanovllm.layers.layernorm import RMSNorm
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
    if kv_cache.dtype != layer.input_layernorm.weight.dtype:
        reasons.append(f"kv_cache_dtype {kv_cache.dtype}")
    if len({x.self_attn.attn.sliding_window for x in decoder.layers}) > 1:
        reasons.append("sliding windows on some layers only")
    if attn.head_dim not in (32, 64, 128):
        reasons.append(f"head_dim {attn.head_dim}")
    if not kv_cache.is_cuda:
        reasons.append("not on CUDA")
    elif fp8_format(decoder)[0] == "block":  # right in the interpreter and at batch 1, not yet on the GPU
        reasons.append("block-wise fp8 weights (wrong by 0.7-1.5% at batch 16 on the H200, measured 2026-12-04)")
    return reasons


PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def _projections(layer) -> dict[str, nn.Module]:
    attn, mlp = layer.self_attn, layer.mlp
    return dict(qkv_proj=attn.qkv_proj, o_proj=attn.o_proj, gate_up_proj=mlp.gate_up_proj, down_proj=mlp.down_proj)


def _scale(linear: nn.Module) -> torch.Tensor | None:
    """A projection's fp8 scales (block-wise ``weight_scale_inv`` or per-channel ``weight_scale``), None unquantized."""
    if linear.quant_method is None:
        return None
    scale = linear.weight_scale_inv if linear.quant_method.quant_config.is_checkpoint_fp8_serialized \
        else linear.weight_scale
    if scale.dtype != torch.float32 or not scale.is_contiguous():
        raise ValueError(f"the persistent decode kernel reads contiguous float32 fp8 scales, got {scale.dtype} "
                         f"of strides {scale.stride()}")
    return scale


def fp8_format(decoder: DecoderModel) -> tuple[str | None, tuple[int, int] | None]:
    """(``DecodePlan.fp8``, weight_block_size) of the decoder's projections: one format for all of them (the kernel
    has one), else a ValueError naming the projections that differ."""
    formats = {}
    for i, layer in enumerate(decoder.layers):
        for name, linear in _projections(layer).items():
            method = linear.quant_method
            if method is None:
                key = (None, None)
            elif method.quant_config.is_checkpoint_fp8_serialized:
                key = ("block", tuple(method.block))
            else:
                key = ("channel", None)
            formats.setdefault(key, []).append(f"layers.{i}.{name}")
    if len(formats) > 1:
        found = "; ".join(f"{fmt or 'unquantized'}{'' if block is None else f' {list(block)}'}: "
                          f"{', '.join(names[:3])}{', ...' if len(names) > 3 else ''}"
                          for (fmt, block), names in formats.items())
        raise ValueError(f"the persistent decode kernel reads one weight format for every projection, the model has "
                         f"several ({found}); set persistent_decode_max_batch=0")
    return next(iter(formats))


def _layer_params(layer) -> dict:
    attn, mlp = layer.self_attn, layer.mlp
    norm = lambda name: getattr(attn, name).weight if hasattr(attn, name) else None  # noqa: E731
    projections = _projections(layer)
    return dict(input_layernorm=layer.input_layernorm.weight, qkv_proj=attn.qkv_proj.weight,
                qkv_bias=attn.qkv_proj.bias, q_norm=norm("q_norm"), k_norm=norm("k_norm"), o_proj=attn.o_proj.weight,
                post_attention_layernorm=layer.post_attention_layernorm.weight, gate_up_proj=mlp.gate_up_proj.weight,
                down_proj=mlp.down_proj.weight, **{f"{name}_scale": _scale(projections[name]) for name in PROJECTIONS})


class PersistentDecoder:
    """The kernel's plan, its scratch buffers and the table of each layer's weight pointers (the parameters'
    storage: weights copied into place stay seen). ``options``: ``decode_layers``' tuning keywords."""

    def __init__(self, model: nn.Module, kv_cache: torch.Tensor, num_programs: int, max_batch_size: int = BLOCK_M,
                 **options):
        from nanovllm.kernels.triton_decode import TABLE, DecodeScratch
        self.model, self.kv_cache, self.max_batch_size, self.options = model, kv_cache, max_batch_size, options
        decoder: DecoderModel = model.model
        layer = decoder.layers[0]
        attn = layer.self_attn
        fp8, block = fp8_format(decoder)
        self.plan = DecodePlan.build(decoder.norm.weight.numel(), attn.num_heads, attn.num_kv_heads, attn.head_dim,
                                     layer.mlp.down_proj.weight.size(1), num_programs, fp8, block)
        weight = layer.input_layernorm.weight  # the model's dtype (a projection's may be fp8)
        self.scratch = DecodeScratch(self.plan, weight.dtype, weight.device, len(decoder.layers))
        self.qk_norm, self.qkv_bias = hasattr(attn, "q_norm"), attn.qkv_proj.bias is not None
        self.eps, self.attn = layer.input_layernorm.eps, attn.attn
        eps = {x.eps for x in decoder.modules() if isinstance(x, RMSNorm)}
        if len(eps) > 1:
            raise ValueError(f"the persistent decode kernel needs one RMSNorm eps, the model has {sorted(eps)}")
        rows = [[0 if (p := _layer_params(x)[name]) is None else p.data_ptr() for name in TABLE]
                for x in decoder.layers]
        self.table = torch.tensor(rows, dtype=torch.int64, device=weight.device)
        self.resident_per_sm: int | None = None  # known after the first launch

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The final hidden states [bs, hidden] of a decode step (``model(input_ids, positions)``'s)."""
        from nanovllm.kernels.triton_decode import decode_layers, resident_programs_per_sm
        decoder: DecoderModel = self.model.model
        ctx = get_context()
        r = decoder.embed_tokens(input_ids)
        args = (self.plan, self.scratch, r, self.table, self.kv_cache, decoder.rotary_emb.cos_sin_cache, positions,
                ctx.slot_mapping, ctx.context_lens, ctx.block_tables)
        kwargs = dict(eps=self.eps, scale=self.attn.scale, window=self.attn.sliding_window, qk_norm=self.qk_norm,
                      qkv_bias=self.qkv_bias, **self.options)
        if self.resident_per_sm is None and r.is_cuda:  # every program must be resident, or a barrier never ends
            self.resident_per_sm = resident_programs_per_sm(decode_layers(*args, **kwargs, check_only=True), r.device)
            sms = torch.cuda.get_device_properties(r.device).multi_processor_count
            if self.resident_per_sm * sms < self.plan.num_programs:
                raise ValueError(f"the persistent decode kernel's {self.plan.num_programs} programs do not fit at "
                                 f"once on {sms} SMs ({self.resident_per_sm} each)")
        decode_layers(*args, **kwargs)
        return decoder.norm(r)
