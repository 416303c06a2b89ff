"""Engine configuration: one frozen dataclass of the core's fields, validated and resolved (every
"auto", the model's config and class) in ``__post_init__``; ``derive`` makes the copy holding what
start-up measures. vLLM's keywords, Hub ids and presets are the frontend's (``entrypoints``)."""
from __future__ import annotations

import copy
import dataclasses
import json
import logging
import os
from dataclasses import dataclass, field

import torch
from transformers import AutoConfig, PretrainedConfig

from nanovllm.layers.attention import resolve_backend
from nanovllm.layers.rotary_embedding import rope_parameters
from nanovllm.models import llama  # noqa: F401 (registers the dense families)
from nanovllm.plugins import get_model_class
from nanovllm.sampling_params import check_bool, check_int

# vLLM's dtype names; their torch dtypes are accepted too
_DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
           "float16": torch.float16, "half": torch.float16}

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
    # None: the model directory's config.json (the frontend passes presets' and overridden ones)
    hf_config: PretrainedConfig | None = field(default=None, repr=False)
    # (registered feature, its options) installed on every rank (``plugins.Feature``)
    features: tuple[tuple[str, dict], ...] = ()
    # resolved in __post_init__
    model_class: type | None = field(default=None, init=False, repr=False)
    torch_dtype: torch.dtype | None = field(default=None, init=False)
    kv_cache_torch_dtype: torch.dtype | None = field(default=None, init=False)
    eos_token_ids: tuple[int, ...] = field(default=(), init=False)

    def __post_init__(self):
        if not isinstance(self.model, (str, os.PathLike)):
            raise TypeError(f"model must be a checkpoint directory, got {self.model!r}")
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        self._set(**{name: defaults[name] for name in _NONE_IS_DEFAULT
                     if getattr(self, name) is None})
        self._check_values()
        self._set(model=os.fspath(self.model),
                  hf_config=self.hf_config or load_hf_config(os.fspath(self.model)))
        device = self.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' but CUDA is not available")
        if device == "cuda" and self.tensor_parallel_size > torch.cuda.device_count():
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size} exceeds the "
                             f"{torch.cuda.device_count()} visible GPU(s)")
        self._set(device=device, async_scheduling=self.async_scheduling
                  if self.async_scheduling is not None else device == "cuda")
        self._resolve_model()
        self._set(torch_dtype=self._resolve_dtype())
        self._set(kv_cache_torch_dtype=self.torch_dtype if self.kv_cache_dtype == "auto"
                  else torch.float8_e4m3fn)
        # an unusable backend fails here; without a block size, choose with one every backend takes
        backend = resolve_backend(self.attention_backend, self.device, self.torch_dtype,
                                  self.kvcache_block_size or 256, self.model_class.head_dim(
                                      self.hf_config), self.kv_cache_torch_dtype)
        self._set(attention_backend=backend,
                  kvcache_block_size=self.kvcache_block_size or DEFAULT_BLOCK_SIZE[backend])

    def _resolve_model(self):
        """The model class, ``max_model_len`` within its positions, and what it cannot build."""
        hf = self.hf_config
        model_len = hf.max_position_embeddings
        max_model_len = model_len if self.max_model_len in (None, -1) else self.max_model_len
        if max_model_len > model_len:
            logger.info("max_model_len lowered from %d to the model's %d positions "
                        "(max_position_embeddings)", max_model_len, model_len)
        # an unsupported architecture fails here, before any process starts
        self._set(model_class=get_model_class(hf), max_model_len=min(max_model_len, model_len))
        self.model_class.check_config(hf, self.max_model_len)
        if self.enable_chunked_prefill is False and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(f"enable_chunked_prefill=False needs max_num_batched_tokens "
                             f"({self.max_num_batched_tokens}) >= max_model_len "
                             f"({self.max_model_len})")
        for name, value in self.model_class.sharded_sizes(hf).items():
            if value and value % self.tensor_parallel_size:
                raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size} must divide "
                                 f"the model's {name}={value}")

    def _set(self, **values) -> Config:
        for name, value in values.items():
            object.__setattr__(self, name, value)
        return self

    def derive(self, **values) -> Config:
        """A copy with what start-up found (``eos_token_ids``, ``num_kvcache_blocks``,
        ``max_model_len``)."""
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
            raise ValueError(f"dtype must be 'auto', one of {sorted(_DTYPES)} or their torch dtype, "
                             f"got {self.dtype!r}")
        for name, choices in _CHOICES.items():
            if getattr(self, name) not in choices:
                raise ValueError(f"{name} must be one of {choices}, got {getattr(self, name)!r}")
        for name in ("skip_tokenizer_init", "enable_prefix_caching", "enforce_eager"):
            check_bool(name, getattr(self, name))
        for name in ("async_scheduling", "enable_chunked_prefill"):
            if getattr(self, name) is not None:
                check_bool(name, getattr(self, name))

    def _resolve_dtype(self) -> torch.dtype:
        if self.dtype != "auto":
            return _DTYPES.get(self.dtype, self.dtype)
        if self.device == "cpu":
            return torch.float32
        hf = self.hf_config
        dtype = getattr(hf, "dtype", None) or getattr(hf, "torch_dtype", None)
        dtype = _DTYPES.get(dtype) if isinstance(dtype, str) else dtype  # config.json: a name
        return dtype if dtype in _DTYPES.values() else torch.bfloat16


def load_hf_config(model: str) -> PretrainedConfig:
    """A checkpoint directory's config.json."""
    if not os.path.isdir(model):
        raise ValueError(f"model directory {model!r} does not exist")
    path = os.path.join(model, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"model directory {model!r} has no config.json")
    with open(path) as f:  # before transformers divides by its fields
        rope_parameters(json.load(f))
    return AutoConfig.from_pretrained(model)


_CHOICES = {"device": ("auto", "cuda", "cpu"), "kv_cache_dtype": ("auto", "fp8", "fp8_e4m3"),
            "attention_backend": ("auto", "flash-attn", "triton", "torch"),
            "load_format": ("auto", "safetensors", "dummy")}
# kvcache_block_size's default per backend: flash-attn's paged KV needs multiples of 256; 64 lets a
# shared prefix of 64 tokens or more hit the prefix cache
DEFAULT_BLOCK_SIZE = {"triton": 64, "flash-attn": 256, "torch": 64}
# the fields where vLLM's None means our default (max_model_len's and kvcache_block_size's None are
# resolved later)
_NONE_IS_DEFAULT = ("max_num_batched_tokens", "max_num_seqs", "num_kvcache_blocks", "seed",
                    "enable_prefix_caching")
