"""Engine configuration: a frozen dataclass, validated and resolved once in ``__post_init__`` (every "auto",
``hf_config``, ``model_class``; ``max_model_len`` capped at the model's positions); what start-up measures later
comes in a new object (``derive``). ``model`` is a checkpoint directory, an architecture preset (random weights,
``nanovllm.models.presets``) or ``"nanovllm:demo"`` (a tiny Qwen3 shipped with the package, ``nanovllm.demo``).
Keyword names are nano-vllm's (vLLM's where nano-vllm has none)."""
from __future__ import annotations

import copy
import dataclasses
import os
from dataclasses import dataclass, field

import torch
from transformers import AutoConfig, PretrainedConfig

from nanovllm.sampling_params import check_int

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Config:
    model: str
    max_num_batched_tokens: int = 16384
    max_num_seqs: int = 512
    max_model_len: int = 4096
    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int = 1
    enforce_eager: bool = False
    kvcache_block_size: int = 256
    num_kvcache_blocks: int = -1
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    attention_backend: str = "auto"   # "auto", "flash-attn", "triton" or "torch"
    load_format: str = "auto"         # "auto" (safetensors) or "dummy" (random weights, for benchmarks)
    skip_tokenizer_init: bool = False  # no tokenizer: prompts are token ids, outputs carry no text
    enable_prefix_caching: bool = True
    tokenizer: str | None = None       # a tokenizer directory other than the model's
    # Launch step N+1 while the device runs step N (its sampled tokens stay on the device). None: on for CUDA only.
    async_scheduling: bool | None = None
    cpu_kvcache_space: float = 4.0     # GiB of KV cache per rank on CPU, when num_kvcache_blocks is not given
    # Resolved from the above.
    hf_config: PretrainedConfig | None = field(default=None, init=False, repr=False)
    model_class: type | None = field(default=None, init=False, repr=False)
    torch_dtype: torch.dtype | None = field(default=None, init=False)
    eos_token_ids: tuple[int, ...] = field(default=(), init=False)

    @classmethod
    def from_kwargs(cls, model: str, **kwargs) -> Config:
        """Like ``Config(model, **kwargs)`` but names every unknown keyword at once; vLLM's names
        for the same settings are accepted too (``block_size`` for ``kvcache_block_size``)."""
        for alias, name in _ALIASES.items():
            if alias in kwargs:
                if name in kwargs:
                    raise TypeError(f"pass {name} or its alias {alias}, not both")
                kwargs[name] = kwargs.pop(alias)
        public = {f.name for f in dataclasses.fields(cls) if f.init}
        if unknown := sorted(set(kwargs) - public):
            raise TypeError(f"unknown engine argument(s) {unknown}; allowed: {sorted(public - {'model'})}")
        return cls(model, **kwargs)

    def __post_init__(self):
        if not isinstance(self.model, (str, os.PathLike)):
            raise TypeError(f"model must be a path to a local checkpoint or 'nanovllm:demo', got {self.model!r}")
        from nanovllm.demo import resolve_model
        self._set(model=resolve_model(os.fspath(self.model)))  # "nanovllm:demo" -> its directory
        self._check_values()
        self._set(hf_config=self._load_hf_config())
        if self.device == "auto":
            self._set(device="cuda" if torch.cuda.is_available() else "cpu")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' was asked for but CUDA is not available")
        if self.async_scheduling is None:
            self._set(async_scheduling=self.device == "cuda")
        if self.device == "cuda" and self.tensor_parallel_size > torch.cuda.device_count():
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size} exceeds the "
                             f"{torch.cuda.device_count()} visible GPU(s)")
        from nanovllm.models import get_model_class
        # an unsupported architecture fails here, before any process starts
        self._set(model_class=get_model_class(self.hf_config),
                  max_model_len=min(self.max_model_len, self.hf_config.max_position_embeddings))
        self.model_class.check_config(self.hf_config, self.max_model_len)
        self._set(torch_dtype=self._resolve_dtype())
        for name in ("num_attention_heads", "num_key_value_heads"):
            value = getattr(self.hf_config, name, None) or self.hf_config.num_attention_heads
            if value % self.tensor_parallel_size:
                raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size} must divide the model's "
                                 f"{name}={value}")
        from nanovllm.layers.attention import resolve_backend
        from nanovllm.models.llama import head_dim_of
        # an unusable attention_backend fails here, naming what it does not support
        self._set(attention_backend=resolve_backend(self.attention_backend, self.device, self.torch_dtype,
                                                    self.kvcache_block_size, head_dim_of(self.hf_config)))

    def _set(self, **values) -> Config:
        for name, value in values.items():
            object.__setattr__(self, name, value)
        return self

    def derive(self, **values) -> Config:
        """A copy with what start-up found (``eos_token_ids``, ``num_kvcache_blocks``, ``max_model_len``)."""
        return copy.copy(self)._set(**values)

    def _check_values(self):
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len", "tensor_parallel_size",
                     "kvcache_block_size"):
            check_int(name, getattr(self, name), lo=1)
        check_int("num_kvcache_blocks", self.num_kvcache_blocks, lo=-1)
        check_int("seed", self.seed, lo=0)
        if self.num_kvcache_blocks == 0:
            raise ValueError("num_kvcache_blocks must be -1 (size automatically) or >= 1, got 0")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if not self.cpu_kvcache_space > 0:
            raise ValueError(f"cpu_kvcache_space must be > 0 GiB, got {self.cpu_kvcache_space!r}")
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {self.dtype!r}")
        for name, choices in (("device", ("auto", "cuda", "cpu")),
                              ("attention_backend", ("auto", "flash-attn", "triton", "torch")),
                              ("load_format", ("auto", "safetensors", "dummy"))):
            if getattr(self, name) not in choices:
                listed = ", ".join(map(repr, choices[:-1])) + f" or {choices[-1]!r}"
                raise ValueError(f"{name} must be {listed}, got {getattr(self, name)!r}")
        for name in ("skip_tokenizer_init", "enable_prefix_caching", "enforce_eager"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise TypeError(f"async_scheduling must be a bool or None (auto), got {self.async_scheduling!r}")

    def _load_hf_config(self) -> PretrainedConfig:
        """A checkpoint directory's config.json, or a built-in preset (random weights only)."""
        from nanovllm.demo import BUILTIN_MODELS
        from nanovllm.models.presets import PRESETS, preset_config
        if self.model in PRESETS and not os.path.isdir(self.model):
            if self.load_format != "dummy" or not self.skip_tokenizer_init:
                raise ValueError(f"model {self.model!r} is a built-in architecture preset with no weights and no "
                                 "tokenizer: use load_format='dummy' and skip_tokenizer_init=True")
            return preset_config(self.model)
        if not os.path.isdir(self.model):
            raise ValueError(f"model directory {self.model!r} does not exist (built-in models: "
                             f"{sorted(BUILTIN_MODELS)}; architecture presets: {sorted(PRESETS)})")
        if not os.path.isfile(os.path.join(self.model, "config.json")):
            raise ValueError(f"model directory {self.model!r} has no config.json")
        return AutoConfig.from_pretrained(self.model)

    def _resolve_dtype(self) -> torch.dtype:
        if self.dtype != "auto":
            return _DTYPES[self.dtype]
        if self.device == "cpu":
            return torch.float32
        dtype = getattr(self.hf_config, "dtype", None) or getattr(self.hf_config, "torch_dtype", None)
        dtype = _DTYPES.get(dtype) if isinstance(dtype, str) else dtype  # a name, in config.json
        return dtype if dtype in _DTYPES.values() else torch.bfloat16


_ALIASES = {"block_size": "kvcache_block_size"}  # vLLM's name -> ours
