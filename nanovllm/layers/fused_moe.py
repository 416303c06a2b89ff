"""A mixture-of-experts layer's experts (vLLM's ``FusedMoE``): ``w13_weight [E, 2 * I/tp, H]`` (gate rows, then up
rows) and ``w2_weight [E, H, I/tp]``, sharded along the intermediate dimension as vLLM shards them."""
from __future__ import annotations

import torch
from torch import nn

from nanovllm.kernels import moe_ops
from nanovllm.layers.linear import check_shape
from nanovllm.utils.distributed import all_reduce, get_tp, get_tp_group


class FusedMoE(nn.Module):
    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, renormalize: bool):
        super().__init__()
        self.tp_rank, self.tp_size = get_tp()
        self.tp_group = get_tp_group()
        self.num_experts, self.top_k, self.hidden_size, self.renormalize = num_experts, top_k, hidden_size, renormalize
        self.intermediate_size_per_partition = ip = intermediate_size // self.tp_size
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * ip, hidden_size), requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, ip), requires_grad=False)
        for param in (self.w13_weight, self.w2_weight):
            param.weight_loader = self.weight_loader
        self._loaded: set[tuple[int, str]] = set()  # (expert, shard id) pairs the checkpoint gave

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, expert_id: int | None, shard_id: str):
        """Expert ``expert_id``'s gate (w1), up (w3) or down (w2) projection; with ``expert_id`` None, every
        expert's packed gate and up (w13, [E, 2 * I, H]) or down (w2, [E, H, I])."""
        ip, e, h = self.intermediate_size_per_partition, self.num_experts, self.hidden_size
        i, lo = ip * self.tp_size, self.tp_rank * ip
        if expert_id is not None and not 0 <= expert_id < e:
            raise ValueError(f"is expert {expert_id} but the model has {e} experts")
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

    def missing_weights(self) -> list[str]:
        """The expert tensors a checkpoint that gave some of them left out ([] when it gave none)."""
        if not self._loaded:
            return []
        return [f"expert {e} {s}" for e in range(self.num_experts) for s in ("w1", "w3", "w2")
                if (e, s) not in self._loaded]

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """residual + the router-weighted sum of each token's top-k experts' MLPs of x."""
        ops = moe_ops(x)
        topk_weights, topk_ids = ops.fused_topk(router_logits, self.top_k, self.renormalize)
        y = ops.fused_moe(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids,
                          residual=residual if self.tp_rank == 0 else None)
        return all_reduce(y, self.tp_group)
