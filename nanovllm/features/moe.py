"""Mixture of experts, a feature: vLLM's ``FusedMoE`` layer (``w13_weight [E, 2 * I/tp, H]``, gate
rows then up rows, and ``w2_weight [E, H, I/tp]``, sharded along the intermediate dimension; in a
block-wise fp8 model fp8 with their stacked ``weight_scale_inv``, which the fused MoE kernel reads
as they are) and Qwen3-MoE, Qwen3's decoder with MoE MLPs except where transformers' rule keeps a
dense one. Registered as the model ``Qwen3MoeForCausalLM``."""
from __future__ import annotations

import math
import re

import torch
from torch import nn
from transformers import PretrainedConfig

from nanovllm.features.fp8 import FP8, checked_scales, get_quant_config
from nanovllm.kernels import moe_reference, ops_for
from nanovllm.layers.linear import ReplicatedLinear, blocks, check_dtype, check_shape
from nanovllm.models.llama import DecoderMLP, DecoderOptions, LlamaForCausalLM, check_silu
from nanovllm.utils.distributed import all_reduce, get_tp, get_tp_group


def moe_ops(x: torch.Tensor):
    """The fused MoE ops for ``x``: Triton's for a CUDA tensor, else the reference."""
    return ops_for(x, "triton_moe", moe_reference)


class FusedMoE(nn.Module):
    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool):
        super().__init__()
        self.tp_rank, self.tp_size = get_tp()
        self.tp_group = get_tp_group()
        self.num_experts, self.top_k, self.hidden_size, self.renormalize = (
            num_experts, top_k, hidden_size, renormalize)
        self.intermediate_size_per_partition = ip = intermediate_size // self.tp_size
        config = get_quant_config()
        self.block = (config.weight_block_size
                      if config is not None and config.is_checkpoint_fp8_serialized else None)
        dtype = None if self.block is None else FP8
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * ip, hidden_size, dtype=dtype),
                                       requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, ip, dtype=dtype),
                                      requires_grad=False)
        params = [self.w13_weight, self.w2_weight]
        if self.block is not None:
            bn, bk = self.block
            scales = (num_experts, math.ceil(2 * ip / bn), math.ceil(hidden_size / bk)), \
                (num_experts, math.ceil(hidden_size / bn), math.ceil(ip / bk))
            self.w13_weight_scale_inv, self.w2_weight_scale_inv = (
                nn.Parameter(torch.empty(shape, dtype=torch.float32), requires_grad=False)
                for shape in scales)
            params += [self.w13_weight_scale_inv, self.w2_weight_scale_inv]
            for param in params[2:]:
                param.block = self.block
        for param in params:  # the experts' block scales are checked first
            param.weight_loader = (checked_scales(self.weight_loader) if hasattr(param, "block")
                                   else self.weight_loader)
        self._loaded: set[tuple[int, str]] = set()  # (expert, shard id) pairs the checkpoint gave

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, expert_id: int | None,
                      shard_id: str):
        """Expert ``expert_id``'s gate (w1), up (w3) or down (w2) projection; with ``expert_id``
        None, every expert's packed gate and up (w13, [E, 2 * I, H]) or down (w2, [E, H, I])."""
        e = self.num_experts
        if expert_id is not None and not 0 <= expert_id < e:
            raise ValueError(f"is expert {expert_id} but the model has {e} experts")
        ip, h = self._units(param, shard_id)
        i, lo = ip * self.tp_size, self.tp_rank * ip
        check_dtype(loaded, param)
        experts = range(e) if expert_id is None else [expert_id]
        target = param.data if expert_id is None else param.data[expert_id:expert_id + 1]
        if shard_id in ("w1", "w3"):
            check_shape(loaded, (i, h))
            target.narrow(1, 0 if shard_id == "w1" else ip, ip).copy_(loaded.narrow(0, lo, ip))
        elif shard_id == "w13":
            check_shape(loaded, (e, 2 * i, h))
            target.narrow(1, 0, ip).copy_(loaded.narrow(1, lo, ip))
            target.narrow(1, ip, ip).copy_(loaded.narrow(1, i + lo, ip))
        elif shard_id == "w2":
            check_shape(loaded, (h, i) if expert_id is not None else (e, h, i))
            target.copy_(loaded.narrow(-1, lo, ip).expand_as(target))
        else:
            raise ValueError(f"unknown expert shard {shard_id!r}")
        shards = ("w1", "w3") if shard_id == "w13" else (shard_id,)
        self._loaded.update((expert, shard) for expert in experts for shard in shards)

    def _units(self, param: nn.Parameter, shard_id: str) -> tuple[int, int]:
        """(intermediate rows per rank, hidden size) in ``param``'s units: a block scale's blocks,
        which must not straddle a rank's shard or the gate/up boundary."""
        split = 1 if shard_id == "w2" else 0
        ip = blocks(param, split, self.intermediate_size_per_partition,
                    "the experts' intermediate size per rank")
        return ip, math.ceil(self.hidden_size / getattr(param, "block", (1, 1))[1 - split])

    def missing_weights(self) -> list[str]:
        """The expert tensors a checkpoint that gave some of them left out ([] when it gave
        none)."""
        if not self._loaded:
            return []
        return [f"expert {e} {s}" for e in range(self.num_experts) for s in ("w1", "w3", "w2")
                if (e, s) not in self._loaded]

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """residual + the router-weighted sum of each token's top-k experts' MLPs of x."""
        ops = moe_ops(x)
        topk_weights, topk_ids = ops.fused_topk(router_logits, self.top_k, self.renormalize)
        fp8 = {} if self.block is None else dict(w13_scale=self.w13_weight_scale_inv,
                                                  w2_scale=self.w2_weight_scale_inv,
                                                  block_shape=self.block)
        y = ops.fused_moe(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids,
                          residual=residual if self.tp_rank == 0 else None, **fp8)
        return all_reduce(y, self.tp_group)


# the experts' checkpoint tensors: one per expert and projection (the Hub's), or packed per layer
_PER_EXPERT = re.compile(r"(.*\.experts\.)(\d+)\.(gate_proj|up_proj|down_proj)"
                         r"\.weight(_scale_inv)?")
_PACKED = re.compile(r"(.*\.experts\.)(gate_up_proj|down_proj)")
_SHARDS = {"gate_proj": ("w13_weight", "w1"), "up_proj": ("w13_weight", "w3"),
           "down_proj": ("w2_weight", "w2"), "gate_up_proj": ("w13_weight", "w13")}


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
    return (layer_idx not in (getattr(config, "mlp_only_layers", None) or [])
            and getattr(config, "num_experts", 0) > 0
            and (layer_idx + 1) % getattr(config, "decoder_sparse_step", 1) == 0)


def qwen3_moe_mlp(config: PretrainedConfig, options: DecoderOptions, layer_idx: int) -> nn.Module:
    return (Qwen3MoeSparseMoeBlock(config) if is_sparse_layer(config, layer_idx)
            else DecoderMLP(config, options))


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    @staticmethod
    def options(config: PretrainedConfig) -> DecoderOptions:
        bias = getattr(config, "attention_bias", False)
        return DecoderOptions(qkv_bias=bias, o_bias=bias, qk_norm=True, mlp=qwen3_moe_mlp)

    @staticmethod
    def check_config(config: PretrainedConfig, max_model_len: int):
        LlamaForCausalLM.check_config(config, max_model_len)
        experts, top_k = (getattr(config, "num_experts", 0),
                          getattr(config, "num_experts_per_tok", 0))
        if experts > 0 and not 0 < top_k <= experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be in [1, num_experts={experts}]")
        step = getattr(config, "decoder_sparse_step", 1)
        if isinstance(step, bool) or not isinstance(step, int) or step < 1:
            raise ValueError(f"decoder_sparse_step must be a positive int, got {step!r}")

    @staticmethod
    def sharded_sizes(config: PretrainedConfig) -> dict[str, int | None]:
        sizes = LlamaForCausalLM.sharded_sizes(config)
        if all(is_sparse_layer(config, i) for i in range(config.num_hidden_layers)):
            del sizes["intermediate_size"]  # no dense MLP is built
        return {**sizes, "moe_intermediate_size": getattr(config, "moe_intermediate_size", None)}

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
