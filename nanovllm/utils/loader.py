"""Loads a Hugging Face safetensors checkpoint (one file or shards) into a model, each
parameter through its ``weight_loader`` (which takes this rank's shard and packs q/k/v and
gate/up); ``load_dummy_weights`` fills them with random values instead (vLLM's
``load_format="dummy"``), for benchmarks without a checkpoint."""
from __future__ import annotations

import glob
import os

import torch
from safetensors import safe_open
from torch import nn

from nanovllm.layers.linear import check_shape


def _default_weight_loader(param: nn.Parameter, loaded: torch.Tensor):
    check_shape(loaded, param.shape)
    param.data.copy_(loaded)


def load_model(model: nn.Module, path: str):
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"model directory {path!r} has no *.safetensors weights")
    packed = getattr(model, "packed_modules_mapping", {})
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    for file in files:
        with safe_open(file, "pt", "cpu") as f:
            for name in f.keys():
                target, shard_id = name, None
                for ckpt_name, (packed_name, sid) in packed.items():
                    if f".{ckpt_name}." in name:
                        target, shard_id = name.replace(ckpt_name, packed_name), sid
                        break
                if target not in params:
                    raise ValueError(f"checkpoint tensor {name!r} in {os.path.basename(file)} matches no "
                                     f"parameter of {type(model).__name__}")
                param = params[target]
                loader = getattr(param, "weight_loader", _default_weight_loader)
                try:
                    loader(param, f.get_tensor(name), *(() if shard_id is None else (shard_id,)))
                except ValueError as e:
                    raise ValueError(f"checkpoint tensor {name!r}: {e}") from None
                loaded.add(target)
    _check_all_loaded(model, loaded)


def _check_all_loaded(model: nn.Module, loaded: set[str]):
    # a tied parameter counts as loaded under any of its names
    names_of: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(name)
    missing = [names[0] for names in names_of.values() if not loaded.intersection(names)]
    if missing:
        raise ValueError(f"checkpoint has no weights for {missing[:8]}{' ...' if len(missing) > 8 else ''}")


@torch.no_grad()
def load_dummy_weights(model: nn.Module, seed: int = 0):
    """Random weights of a realistic scale: N(0, 0.02) matrices and biases, unit norm weights."""
    generator = torch.Generator(next(model.parameters()).device).manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        else:
            param.normal_(0.0, 0.02, generator=generator)
