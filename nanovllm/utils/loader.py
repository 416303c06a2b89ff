"""Loads a Hugging Face safetensors checkpoint (one file or shards) into a model, each
parameter through its ``weight_loader`` (which checks the whole tensor's shape, takes this rank's
shard and packs q/k/v and gate/up); ``load_dummy_weights`` fills them with random values instead
(vLLM's ``load_format="dummy"``), for benchmarks without a checkpoint. ``load_tokenizer`` refuses a
directory without tokenizer files up front."""
from __future__ import annotations

import glob
import json
import os

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from nanovllm.layers.linear import check_shape

INDEX_FILE = "model.safetensors.index.json"
# buffers that old checkpoints saved (Llama's rotary tables); the model computes its own
SKIPPED_TENSORS = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
# files that hold a vocabulary: fast (tokenizers), sentencepiece, BPE/WordPiece, tiktoken
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model", "vocab.json",
                   "vocab.txt", "*.tiktoken")


def _default_weight_loader(param: nn.Parameter, loaded: torch.Tensor):
    check_shape(loaded, param.shape)
    param.data.copy_(loaded)


def checkpoint_files(path: str) -> list[str]:
    """The files ``model.safetensors.index.json`` maps tensors to when it exists (a repository may
    ship the same weights again under other names, e.g. Mistral's consolidated.safetensors), else
    every ``*.safetensors`` file."""
    index = os.path.join(path, INDEX_FILE)
    if not os.path.exists(index):
        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
        if not files:
            raise ValueError(f"model directory {path!r} has no *.safetensors weights")
        return files
    try:
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{index!r} is not a safetensors index with a weight_map ({e!r})") from None
    files = [os.path.join(path, name) for name in names]
    missing = [name for name, file in zip(names, files) if not os.path.isfile(file)]
    if missing:
        raise ValueError(f"{INDEX_FILE} in {path!r} names {missing} but the directory has no such file")
    return files


def _packed_target(name: str, packed: dict) -> tuple[str, str | int | None]:
    """(parameter name, shard id) of a checkpoint tensor: q/k/v and gate/up go to their packed parameter."""
    for ckpt_name, (packed_name, shard_id) in packed.items():
        if f".{ckpt_name}." in name:
            return name.replace(ckpt_name, packed_name), shard_id
    return name, None


def _unreadable(file: str, e: Exception) -> ValueError:
    return ValueError(f"checkpoint file {file!r} is not a readable safetensors file (truncated or an "
                      f"interrupted download?): {e}")


def load_model(model: nn.Module, path: str):
    packed = getattr(model, "packed_modules_mapping", {})
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    for file in checkpoint_files(path):
        try:
            f = safe_open(file, "pt", "cpu")
        except (SafetensorError, OSError) as e:
            raise _unreadable(file, e) from None
        with f:
            for name in f.keys():
                if name.endswith(SKIPPED_TENSORS):
                    continue
                target, shard_id = _packed_target(name, packed)
                if target not in params:
                    raise ValueError(f"checkpoint tensor {name!r} in {os.path.basename(file)} matches no "
                                     f"parameter of {type(model).__name__}")
                try:
                    tensor = f.get_tensor(name)
                except (SafetensorError, OSError) as e:
                    raise _unreadable(file, e) from None
                _load_tensor(params[target], tensor, shard_id, name)
                loaded.add(target)
    _check_all_loaded(model, loaded)


def _load_tensor(param: nn.Parameter, tensor: torch.Tensor, shard_id, name: str):
    loader = getattr(param, "weight_loader", _default_weight_loader)
    try:
        loader(param, tensor, *(() if shard_id is None else (shard_id,)))
    except ValueError as e:
        raise ValueError(f"checkpoint tensor {name!r}: {e}") from None


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


def load_tokenizer(path: str):
    """``AutoTokenizer.from_pretrained(path)``, refusing at once a local directory without tokenizer
    files (transformers would build a vocabulary of one token, and generation would fail later)."""
    from transformers import AutoTokenizer

    remedy = "pass tokenizer=<dir> or skip_tokenizer_init=True to run on token ids"
    if os.path.isdir(path) and not any(glob.glob(os.path.join(glob.escape(path), p)) for p in TOKENIZER_FILES):
        raise ValueError(f"{path!r} has no tokenizer files (any of {', '.join(TOKENIZER_FILES)}): {remedy}")
    tokenizer = AutoTokenizer.from_pretrained(path)
    if len(tokenizer) < 2:
        raise ValueError(f"the tokenizer loaded from {path!r} has {len(tokenizer)} token(s): {remedy}")
    return tokenizer


def eos_token_ids(model_dir: str, hf_config, tokenizer) -> tuple[int, ...]:
    """Every EOS id of a checkpoint: generation_config.json's (else config.json's; one or a list) and the
    tokenizer's."""
    ids: set[int] = set()
    path = os.path.join(model_dir, "generation_config.json")
    eos = getattr(hf_config, "eos_token_id", None)
    if os.path.isfile(path):
        with open(path) as f:
            eos = json.load(f).get("eos_token_id", eos)
    ids.update([eos] if isinstance(eos, int) else eos or [])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))
