"""Loads a checkpoint's weights (through parameters' ``weight_loader``), tokenizer and EOS ids."""
from __future__ import annotations

import contextlib
import gc
import glob
import json
import logging
import math
import os
import re

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from nanovllm.layers.linear import check_shape

INDEX_FILE = "model.safetensors.index.json"
SKIPPED_TENSORS = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model",
                   "vocab.json", "vocab.txt", "*.tiktoken")
logger = logging.getLogger("nanovllm")
KV_SCALE = re.compile(r"(?P<layer>.*\.self_attn)\.(?:[kvq]_proj\.|attn\.)?"  # fp8 KV-cache scales
                      r"(?P<which>k_scale|v_scale|kv_scale|q_scale|prob_scale)")


def has_file(directory: str, pattern: str) -> bool:
    return bool(glob.glob(os.path.join(glob.escape(directory), pattern)))


def _default_weight_loader(param: nn.Parameter, loaded: torch.Tensor):
    check_shape(loaded, param.shape)
    param.data.copy_(loaded)


def checkpoint_files(path: str) -> list[str]:
    """The index's files (a repository may ship the weights twice), else every ``*.safetensors``."""
    if not os.path.exists(index := os.path.join(path, INDEX_FILE)):
        if not (files := sorted(glob.glob(os.path.join(path, "*.safetensors")))):
            raise ValueError(f"model directory {path!r} has no *.safetensors weights")
        return files
    try:
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{index!r} is not a safetensors index with a weight_map "
                         f"({e!r})") from None
    files = [os.path.join(path, name) for name in names]
    if missing := [name for name, file in zip(names, files) if not os.path.isfile(file)]:
        raise ValueError(f"{INDEX_FILE} in {path!r} names missing files {missing}")
    return files


def _packed_target(name: str, packed: dict) -> tuple[str, tuple]:
    for ckpt_name, (packed_name, shard_id) in packed.items():
        if f".{ckpt_name}." in name:
            return name.replace(ckpt_name, packed_name), (shard_id,)
    return name, ()


def _load_kv_scale(model: nn.Module, name: str, file) -> bool:  # False: name is no KV-cache scale
    if (match := KV_SCALE.fullmatch(name)) is None:
        return False
    if match["which"] in ("q_scale", "prob_scale"):
        logger.info("checkpoint tensor %s skipped: fp8 attention arithmetic is not supported", name)
        return True
    try:
        attn = model.get_submodule(match["layer"] + ".attn")
    except AttributeError:
        return False
    tensor = file.get_tensor(name)
    value = float(tensor.float().reshape(-1)[0]) if tensor.numel() == 1 else None
    if value is None or not math.isfinite(value) or value <= 0:
        raise ValueError(f"checkpoint tensor {name!r}: a KV-cache scale must be one positive "
                         f"finite value, got shape {tuple(tensor.shape)}"
                         f"{'' if value is None else f' value {value}'}")
    for which in ("k_scale", "v_scale") if match["which"] == "kv_scale" else (match["which"],):
        setattr(attn, which, value)
    return True


def target_resolver(model: nn.Module):
    """Name -> (parameter name, weight_loader's extra arguments): the model's own, else packed."""
    packed = getattr(model, "packed_modules_mapping", {})
    own_target = getattr(model, "checkpoint_target", lambda name: None)
    return lambda name: own_target(name) or _packed_target(name, packed)


def load_model(model: nn.Module, path: str):
    resolve, params = target_resolver(model), dict(model.named_parameters(remove_duplicate=False))
    loaded, names, fp8_weights = set(), set(), {}  # loaded ids: a tied parameter has many names
    for file in checkpoint_files(path):
        base = os.path.basename(file)
        try:
            with safe_open(file, "pt", "cpu") as f:
                for name in f.keys():
                    names.add(name)
                    if name.endswith(SKIPPED_TENSORS) or _load_kv_scale(model, name, f):
                        continue
                    target, shard_args = resolve(name)
                    if target not in params:
                        raise ValueError(f"checkpoint tensor {name!r} in {base} matches no "
                                         f"parameter of {type(model).__name__}")
                    param, tensor = params[target], f.get_tensor(name)
                    if tensor.dtype == torch.float8_e4m3fn:
                        fp8_weights[name] = base
                    try:
                        _load_one(param, shard_args, tensor)
                    except ValueError as e:
                        raise ValueError(f"checkpoint tensor {name!r} in {base}: {e}") from None
                    loaded.add(id(param))
        except (SafetensorError, OSError) as e:
            raise ValueError(f"checkpoint file {file!r} is not a readable safetensors file: "
                             f"{e}") from None
    for name, base in fp8_weights.items():  # every fp8 weight comes with its block scales
        if name + "_scale_inv" not in names:
            raise ValueError(f"checkpoint tensor {name!r} in {base}: is float8_e4m3fn but the "
                             f"checkpoint has no {name + '_scale_inv'!r} (its block scales)")
    missing = [name for name, p in model.named_parameters() if id(p) not in loaded]
    missing += [f"{name} ({', '.join(parts[:4])}{' ...' if len(parts) > 4 else ''})"
                for name, module in model.named_modules()
                if (parts := getattr(module, "missing_weights", list)())]
    if missing:
        raise ValueError(f"checkpoint has no weights for {missing[:8]}"
                         f"{' ...' if len(missing) > 8 else ''}")


def _load_one(param: nn.Parameter, shard_args: tuple, tensor: torch.Tensor):
    getattr(param, "weight_loader", _default_weight_loader)(param, tensor, *shard_args)


@contextlib.contextmanager
def gc_paused():
    """Cyclic GC off inside: collecting a big tokenizer.json's objects took a third of its load."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def load_tokenizer(path: str):
    remedy = "pass tokenizer=<dir> or skip_tokenizer_init=True to run on token ids"
    if os.path.isdir(path) and not any(has_file(path, p) for p in TOKENIZER_FILES):
        raise ValueError(f"{path!r} has no tokenizer files (any of "
                         f"{', '.join(TOKENIZER_FILES)}): {remedy}")
    with gc_paused():
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(path)
    if len(tokenizer) < 2:
        raise ValueError(f"the tokenizer loaded from {path!r} has {len(tokenizer)} token(s): "
                         f"{remedy}")
    return tokenizer


def eos_token_ids(model_dir: str, hf_config, tokenizer) -> tuple[int, ...]:
    """generation_config.json's EOS ids (else config.json's), the model's own first."""
    own = eos = getattr(hf_config, "eos_token_id", None)
    if os.path.isfile(path := os.path.join(model_dir, "generation_config.json")):
        with open(path) as f:
            eos = json.load(f).get("eos_token_id", eos)
    ids = {eos} if isinstance(eos, int) else set(eos or [])
    own = own if getattr(tokenizer, "eos_token_id", None) is None else tokenizer.eos_token_id
    own = own[0] if isinstance(own, (list, tuple)) and own else own
    return tuple(sorted(ids)) if own is None else (own, *sorted(ids - {own}))
