"""Engine configuration: one frozen dataclass, validated and resolved (every "auto", ``hf_config``,
``model_class``) in ``__post_init__``; ``derive`` makes the copy holding what start-up measures."""
from __future__ import annotations

import copy
import dataclasses
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import AutoConfig, PretrainedConfig, set_seed

from nanovllm.layers.quantization import get_quantization_config
from nanovllm.logits_processor import load_logits_processors
from nanovllm.sampling_params import check_bool, check_int

# vLLM's dtype names; their torch dtypes are accepted too
_DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "half": torch.float16}

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
    max_logprobs: int = 20  # the most (prompt) logprobs a request may ask for; -1: the vocabulary size
    attention_backend: str = "auto"
    load_format: str = "auto"  # "dummy": random weights
    skip_tokenizer_init: bool = False  # prompts are then token ids, and outputs carry no text
    enable_prefix_caching: bool = True
    tokenizer: str | None = None  # a directory or Hub id other than the model's
    async_scheduling: bool | None = None  # launch step N+1 while the device runs step N; None: on for CUDA
    cpu_kvcache_space: float = 4.0  # GiB of KV cache per rank on CPU, unless num_kvcache_blocks is given
    kv_cache_dtype: str = "auto"  # "auto" (the model's dtype) or "fp8"/"fp8_e4m3" (scales of 1.0)
    # None or "fp8": a checkpoint's fp8 quantization_config is used either way; "fp8" quantizes a bf16 one at load
    quantization: str | None = None
    # default sampling: "auto" (the model's generation_config.json), "vllm" (SamplingParams') or a directory
    generation_config: str = "auto"
    revision: str | None = None  # for Hub ids; tokenizer_revision defaults to it
    tokenizer_revision: str | None = None
    download_dir: str | None = None
    hf_token: bool | str | None = field(default=None, repr=False)
    logits_processors: list | None = field(default_factory=list)  # vLLM's classes or "module.Class" names
    hf_overrides: dict | Callable | None = None
    enable_chunked_prefill: bool | None = None  # False: a prompt is never split
    profiler_config: dict | None = None  # {"profiler": "torch", "torch_profiler_dir": ...}
    # a class or "module.Class" whose methods every rank's ModelRunner gets (for collective_rpc); "": none
    worker_extension_cls: str | type | None = None
    enable_sleep_mode: bool = False  # sleep() and wake_up() (engine/sleep.py)
    # resolved in __post_init__
    hf_config: PretrainedConfig | None = field(default=None, init=False, repr=False)
    model_class: type | None = field(default=None, init=False, repr=False)
    quant_config: object | None = field(default=None, init=False, repr=False)  # layers.quantization.Fp8Config
    torch_dtype: torch.dtype | None = field(default=None, init=False)
    kv_cache_torch_dtype: torch.dtype | None = field(default=None, init=False)
    eos_token_ids: tuple[int, ...] = field(default=(), init=False)

    @classmethod
    def from_kwargs(cls, model: str, **kwargs) -> Config:
        """``Config(model, **kwargs)`` that also takes vLLM's keywords (``vllm_compat.config_from_kwargs``)."""
        from nanovllm.vllm_compat import config_from_kwargs
        return config_from_kwargs(cls, model, kwargs)

    def __post_init__(self):
        if not isinstance(self.model, (str, os.PathLike)):
            raise TypeError(f"model must be a path, a Hugging Face Hub id or 'nanovllm:demo', got {self.model!r}")
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        self._set(**{name: defaults[name] for name in _NONE_IS_DEFAULT if getattr(self, name) is None})
        self._check_values()
        self._resolve_paths()
        hf_config = self._load_hf_config()
        self._set(hf_config=hf_config, quant_config=get_quantization_config(hf_config, self.quantization))
        self._set(device=("cuda" if torch.cuda.is_available() else "cpu") if self.device == "auto" else self.device)
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' but CUDA is not available")
        if self.async_scheduling is None:
            self._set(async_scheduling=self.device == "cuda")
        if self.device == "cuda" and self.tensor_parallel_size > torch.cuda.device_count():
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size} exceeds the "
                             f"{torch.cuda.device_count()} visible GPU(s)")
        from nanovllm.models import get_model_class
        model_len = self.hf_config.max_position_embeddings
        max_model_len = model_len if self.max_model_len in (None, -1) else self.max_model_len
        if max_model_len > model_len:
            logger.info("max_model_len lowered from %d to the model's %d positions (max_position_embeddings)",
                        max_model_len, model_len)
        # an unsupported architecture fails here, before any process starts
        self._set(model_class=get_model_class(self.hf_config), max_model_len=min(max_model_len, model_len))
        self.model_class.check_config(self.hf_config, self.max_model_len)
        if self.enable_chunked_prefill is False and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(f"enable_chunked_prefill=False needs max_num_batched_tokens "
                             f"({self.max_num_batched_tokens}) >= max_model_len ({self.max_model_len})")
        self._set(torch_dtype=self._resolve_dtype())
        self._check_tensor_parallel_split()
        from nanovllm.layers.attention import resolve_backend
        from nanovllm.models.llama import head_dim_of
        self._set(kv_cache_torch_dtype=self.torch_dtype if self.kv_cache_dtype == "auto" else torch.float8_e4m3fn)
        # an unusable backend fails here; without a block size, choose with one every backend takes
        self._set(attention_backend=resolve_backend(self.attention_backend, self.device, self.torch_dtype,
                                                    self.kvcache_block_size or 256, head_dim_of(self.hf_config),
                                                    self.kv_cache_torch_dtype))
        if self.kvcache_block_size is None:
            self._set(kvcache_block_size=DEFAULT_BLOCK_SIZE[self.attention_backend])

    def _check_tensor_parallel_split(self):
        """``tensor_parallel_size`` must divide every dimension that the ranks shard."""
        from nanovllm.models.qwen3_moe import is_sparse_layer
        hf = self.hf_config
        sizes = {"num_attention_heads": hf.num_attention_heads,
                 "num_key_value_heads": getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads}
        if not all(is_sparse_layer(hf, i) for i in range(hf.num_hidden_layers)):  # a dense MLP is built
            sizes["intermediate_size"] = getattr(hf, "intermediate_size", None)
        sizes["moe_intermediate_size"] = getattr(hf, "moe_intermediate_size", None)
        for name, value in sizes.items():
            if value and value % self.tensor_parallel_size:
                raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size} must divide the model's "
                                 f"{name}={value}")

    def _set(self, **values) -> Config:
        for name, value in values.items():
            object.__setattr__(self, name, value)
        return self

    def derive(self, **values) -> Config:
        """A copy with what start-up found (``eos_token_ids``, ``num_kvcache_blocks``, ``max_model_len``)."""
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
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if not self.cpu_kvcache_space > 0:
            raise ValueError(f"cpu_kvcache_space must be > 0 GiB, got {self.cpu_kvcache_space!r}")
        if not (self.dtype == "auto" or self.dtype in _DTYPES or self.dtype in _DTYPES.values()):
            raise ValueError(f"dtype must be 'auto', one of {sorted(_DTYPES)} or their torch dtype, got {self.dtype!r}")
        if not isinstance(self.generation_config, (str, os.PathLike)) or (
                self.generation_config not in ("auto", "vllm") and not os.path.isdir(self.generation_config)):
            raise ValueError(f"generation_config must be 'auto', 'vllm' or a directory, got {self.generation_config!r}")
        for name, choices in (("device", ("auto", "cuda", "cpu")), ("kv_cache_dtype", ("auto", "fp8", "fp8_e4m3")),
                              ("attention_backend", ("auto", "flash-attn", "triton", "torch")),
                              ("load_format", ("auto", "safetensors", "dummy"))):
            if getattr(self, name) not in choices:
                raise ValueError(f"{name} must be one of {choices}, got {getattr(self, name)!r}")
        for name in ("skip_tokenizer_init", "enable_prefix_caching", "enforce_eager", "enable_sleep_mode"):
            check_bool(name, getattr(self, name))
        for name in ("async_scheduling", "enable_chunked_prefill"):
            if getattr(self, name) is not None:
                check_bool(name, getattr(self, name))
        from nanovllm.engine.worker_extension import load_worker_extension
        from nanovllm.vllm_compat import profiler_options
        self._set(profiler_config=profiler_options(self.profiler_config),
                  logits_processors=load_logits_processors(self.logits_processors),
                  worker_extension_cls=load_worker_extension(self.worker_extension_cls))

    def _resolve_paths(self):
        """``model`` and ``tokenizer`` as local directories; a Hub id's snapshot must hold config.json, and the
        safetensors weights unless they are dummy."""
        from nanovllm.utils.loader import resolve_model
        hub = dict(cache_dir=self.download_dir, token=self.hf_token)
        needs = ("config.json",) if self.load_format == "dummy" else ("config.json", "*.safetensors")
        self._set(model=resolve_model(os.fspath(self.model), needs, self.revision, **hub))
        if self.tokenizer is not None:
            revision = self.tokenizer_revision or self.revision
            self._set(tokenizer=resolve_model(os.fspath(self.tokenizer), (), revision, **hub))

    def _load_hf_config(self) -> PretrainedConfig:
        """A checkpoint directory's config.json, or a built-in preset's (random weights only), overridden."""
        from nanovllm.demo import BUILTIN_MODELS
        from nanovllm.models.presets import PRESETS, preset_config
        from nanovllm.vllm_compat import apply_hf_overrides
        if self.model in PRESETS and not os.path.isdir(self.model):
            if self.load_format != "dummy" or not self.skip_tokenizer_init:
                raise ValueError(f"model {self.model!r} is an architecture preset (no weights, no tokenizer): "
                                 "pass load_format='dummy' and skip_tokenizer_init=True")
            return apply_hf_overrides(preset_config(self.model), self.hf_overrides)
        if not os.path.isdir(self.model):
            raise ValueError(f"model directory {self.model!r} does not exist (built-in models: "
                             f"{sorted(BUILTIN_MODELS)}; presets: {sorted(PRESETS)})")
        if not os.path.isfile(os.path.join(self.model, "config.json")):
            raise ValueError(f"model directory {self.model!r} has no config.json")
        from nanovllm.layers.rotary_embedding import rope_parameters
        with open(os.path.join(self.model, "config.json")) as f:  # before transformers divides by its fields
            rope_parameters(json.load(f))
        return apply_hf_overrides(AutoConfig.from_pretrained(self.model), self.hf_overrides)

    def _resolve_dtype(self) -> torch.dtype:
        if self.dtype != "auto":
            return _DTYPES.get(self.dtype, self.dtype)
        if self.device == "cpu":
            return torch.float32
        dtype = getattr(self.hf_config, "dtype", None) or getattr(self.hf_config, "torch_dtype", None)
        dtype = _DTYPES.get(dtype) if isinstance(dtype, str) else dtype  # config.json's is a name
        return dtype if dtype in _DTYPES.values() else torch.bfloat16


# kvcache_block_size's default per backend: flash-attn's paged KV needs multiples of 256; 64 lets a shared prefix
# of 64 tokens or more hit the prefix cache
DEFAULT_BLOCK_SIZE = {"triton": 64, "flash-attn": 256, "torch": 64}
# the fields where vLLM's None means our default (max_model_len's and kvcache_block_size's None are resolved later)
_NONE_IS_DEFAULT = ("max_num_batched_tokens", "max_num_seqs", "num_kvcache_blocks", "seed",
                    "enable_prefix_caching")

set_random_seed = set_seed  # seeds Python's, NumPy's and torch's generators, as vLLM does at start-up
VllmConfig = Config  # the name vLLM's logits processors annotate their first argument with
