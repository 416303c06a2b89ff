"""Engine configuration: a frozen dataclass resolved in ``__post_init__``, copied by ``derive``."""
from __future__ import annotations

import copy
import json
import logging
import os
from dataclasses import dataclass, field, fields

import torch
from transformers import AutoConfig, PretrainedConfig

from nanovllm.layers.attention import resolve_backend
from nanovllm.layers.rotary_embedding import rope_parameters
from nanovllm.models import llama  # noqa: F401 (registers the dense families)
from nanovllm.plugins import get_model_class
from nanovllm.sampling_params import check_bool, check_int

_DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
           "float16": torch.float16, "half": torch.float16}  # vLLM's names (torch dtypes too)
logger = logging.getLogger("nanovllm")


@dataclass(frozen=True)
class Config:
    model: str
    max_num_batched_tokens: int = 16384
    max_num_seqs: int = 512
    max_model_len: int | None = 4096  # None or -1: the model's; lowered to what the KV cache holds
    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int = 1
    enforce_eager: bool = False
    kvcache_block_size: int | None = None  # None: the attention backend's DEFAULT_BLOCK_SIZE
    num_kvcache_blocks: int = -1
    dtype: str | torch.dtype = "auto"
    device: str = "auto"
    seed: int | None = 0  # None: 0, as in vLLM V1
    max_logprobs: int = 20  # the most (prompt) logprobs a request may ask for; -1: the vocabulary
    attention_backend: str = "auto"
    load_format: str = "auto"  # "dummy": random weights
    skip_tokenizer_init: bool = False  # prompts are then token ids, and outputs carry no text
    enable_prefix_caching: bool = True
    tokenizer: str | None = None  # a directory other than the model's
    async_scheduling: bool | None = None  # launch step N+1 while the device runs step N; None: CUDA
    cpu_kvcache_space: float = 4.0  # GiB of KV cache per rank on CPU, unless num_kvcache_blocks
    kv_cache_dtype: str = "auto"  # "auto" (the model's dtype) or "fp8"/"fp8_e4m3" (scales of 1.0)
    enable_chunked_prefill: bool | None = None  # False: a prompt is never split
    disable_cascade_attn: bool = False  # True: decode reads shared prefixes once per sequence
    hf_config: PretrainedConfig | None = field(default=None, repr=False)  # None: config.json's
    features: tuple[tuple[str, dict], ...] = ()  # (registered feature, its options) on every rank
    model_class: type | None = field(default=None, init=False, repr=False)  # set in __post_init__
    torch_dtype: torch.dtype | None = field(default=None, init=False)
    kv_cache_torch_dtype: torch.dtype | None = field(default=None, init=False)
    eos_token_ids: tuple[int, ...] = field(default=(), init=False)

    def __post_init__(self):
        if not isinstance(self.model, (str, os.PathLike)):
            raise TypeError(f"model must be a checkpoint directory, got {self.model!r}")
        defaults = {f.name: f.default for f in fields(self) if f.name in _NONE_IS_DEFAULT}
        self._set(**{name: defaults[name] for name in defaults if getattr(self, name) is None})
        self._check_values()
        hf = self.hf_config or load_hf_config(os.fspath(self.model))
        self._set(model=os.fspath(self.model), hf_config=hf)
        if self.device == "auto":
            self._set(device="cuda" if torch.cuda.is_available() else "cpu")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' but CUDA is not available")
        if self.device == "cuda" and self.tensor_parallel_size > torch.cuda.device_count():
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size} exceeds the "
                             f"{torch.cuda.device_count()} visible GPU(s)")
        if self.async_scheduling is None:
            self._set(async_scheduling=self.device == "cuda")
        model_len = hf.max_position_embeddings
        max_model_len = model_len if self.max_model_len in (None, -1) else self.max_model_len
        if max_model_len > model_len:
            logger.info("max_model_len lowered from %d to the model's %d positions "
                        "(max_position_embeddings)", max_model_len, model_len)
        max_model_len = min(max_model_len, model_len)
        self._set(model_class=get_model_class(hf), max_model_len=max_model_len)
        self.model_class.check_config(hf, max_model_len)
        if self.enable_chunked_prefill is False and self.max_num_batched_tokens < max_model_len:
            raise ValueError(f"enable_chunked_prefill=False needs max_num_batched_tokens "
                             f"({self.max_num_batched_tokens}) >= max_model_len ({max_model_len})")
        for name, value in self.model_class.sharded_sizes(hf).items():
            if value and value % self.tensor_parallel_size:
                raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size} must divide "
                                 f"the model's {name}={value}")
        if self.dtype != "auto":
            dtype = _DTYPES.get(self.dtype, self.dtype)
        elif self.device == "cpu":
            dtype = torch.float32
        else:  # config.json's, by name
            dtype = getattr(hf, "dtype", None) or getattr(hf, "torch_dtype", None)
            dtype = _DTYPES.get(dtype, dtype if dtype in _DTYPES.values() else torch.bfloat16)
        self._set(torch_dtype=dtype, kv_cache_torch_dtype=dtype if self.kv_cache_dtype == "auto"
                  else torch.float8_e4m3fn)
        backend = resolve_backend(self.attention_backend, self.device, self.torch_dtype,
                                  self.kvcache_block_size or 256, self.model_class.head_dim(hf),
                                  self.kv_cache_torch_dtype)
        self._set(attention_backend=backend,  # flash-attn's decode has no cascade (logged there)
                  disable_cascade_attn=self.disable_cascade_attn or backend == "flash-attn",
                  kvcache_block_size=self.kvcache_block_size or DEFAULT_BLOCK_SIZE[backend])

    def _set(self, **values) -> Config:
        for name, value in values.items():
            object.__setattr__(self, name, value)
        return self

    def derive(self, **values) -> Config:
        return copy.copy(self)._set(**values)

    def _check_values(self):
        for name in ("max_num_batched_tokens", "max_num_seqs", "tensor_parallel_size"):
            check_int(name, getattr(self, name), lo=1)
        if self.kvcache_block_size is not None:
            check_int("kvcache_block_size", self.kvcache_block_size, lo=1)
        if self.max_model_len not in (None, -1):
            check_int("max_model_len", self.max_model_len, lo=1)
        check_int("num_kvcache_blocks", self.num_kvcache_blocks, lo=-1)
        check_int("seed", self.seed, lo=0, hi=2 ** 32 - 1)  # vLLM's range (numpy's seeds)
        check_int("max_logprobs", self.max_logprobs, lo=-1)
        if self.num_kvcache_blocks == 0:
            raise ValueError("num_kvcache_blocks must be -1 (auto) or >= 1, got 0")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], "
                             f"got {self.gpu_memory_utilization!r}")
        if not self.cpu_kvcache_space > 0:
            raise ValueError(f"cpu_kvcache_space must be > 0 GiB, got {self.cpu_kvcache_space!r}")
        if not (self.dtype == "auto" or self.dtype in _DTYPES or self.dtype in _DTYPES.values()):
            raise ValueError(f"dtype must be 'auto', one of {sorted(_DTYPES)} or their torch "
                             f"dtype, got {self.dtype!r}")
        for name, choices in CHOICES.items():
            if getattr(self, name) not in choices:
                raise ValueError(f"{name} must be one of {choices}, got {getattr(self, name)!r}")
        for name in ("skip_tokenizer_init", "enable_prefix_caching", "enforce_eager",
                     "disable_cascade_attn"):
            check_bool(name, getattr(self, name))
        for name in ("async_scheduling", "enable_chunked_prefill"):
            if getattr(self, name) is not None:
                check_bool(name, getattr(self, name))


def load_hf_config(model: str) -> PretrainedConfig:
    if not os.path.isdir(model):
        raise ValueError(f"model directory {model!r} does not exist")
    if not os.path.isfile(path := os.path.join(model, "config.json")):
        raise ValueError(f"model directory {model!r} has no config.json")
    with open(path) as f:  # checked before transformers divides by its fields
        try:
            fields = json.load(f)
        except ValueError as e:
            raise ValueError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(fields, dict):
        raise ValueError(f"{path} must hold a JSON object, got a {type(fields).__name__}")
    if not isinstance(fields.get("quantization_config") or {}, dict):  # transformers' error
        raise ValueError(f"{path}: quantization_config must be a JSON object, "
                         f"got {fields['quantization_config']!r:.80}")
    rope_parameters(fields)
    return AutoConfig.from_pretrained(model)


CHOICES = {"device": ("auto", "cuda", "cpu"), "kv_cache_dtype": ("auto", "fp8", "fp8_e4m3"),
           "attention_backend": ("auto", "flash-attn", "triton", "torch"),
           "load_format": ("auto", "safetensors", "dummy")}  # what these fields accept
DEFAULT_BLOCK_SIZE = {"triton": 64, "flash-attn": 256, "torch": 64}  # flash-attn: multiples of 256
_NONE_IS_DEFAULT = ("max_num_batched_tokens", "max_num_seqs", "num_kvcache_blocks", "seed",
                    "enable_prefix_caching")  # where vLLM's None means our default
VllmConfig = Config  # the name vLLM's logits processors annotate their first argument with
