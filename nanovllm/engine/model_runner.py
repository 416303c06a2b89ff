"""One rank's model on its device: loading, KV-cache sizing, CUDA-graph decode, rank 0 sampling."""
from __future__ import annotations

import contextlib
import gc
import logging
import threading
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from nanovllm.config import Config
from nanovllm.engine.batch import StepInput
from nanovllm.engine.cuda_graph import DecodeGraphs, warmup_model
from nanovllm.engine.logprobs import prompt_logprobs
from nanovllm.engine.outputs import ModelRunnerOutput
from nanovllm.engine.sampling import SamplingInputs, SamplingPreparer
from nanovllm.engine.scheduler import SchedulerOutput
from nanovllm.layers.attention import Attention, bind_backend
from nanovllm.layers.sampler import Sampler
from nanovllm.models.presets import load_dummy_weights
from nanovllm.plugins import REGISTRY
from nanovllm.utils.context import get_context, set_context
from nanovllm.utils.distributed import tensor_parallel
from nanovllm.utils.loader import load_model

if TYPE_CHECKING:
    from nanovllm.engine.worker_group import TPGroup

logger = logging.getLogger("nanovllm")
_BUILD_LOCK = threading.Lock()  # torch's default dtype is process-wide: builds take turns


class ModelRunner:
    def __init__(self, config: Config, rank: int, group: TPGroup | None = None):
        self.config, self.rank, self.group = config, rank, group
        hf_config = config.hf_config
        self.block_size, self.kv_dtype = config.kvcache_block_size, config.kv_cache_torch_dtype
        self.is_cuda = config.device == "cuda"
        self.prev_sampled: torch.Tensor | None = None  # the last step's samples (async scheduling)
        self.graphs: DecodeGraphs | None = None
        self.build_contexts, self.after_build, self.extensions = [], [], {}  # features add to them
        self.worker: object = self  # what a call by name reaches (vLLM's worker; a feature's view)
        self.features = [REGISTRY.get("feature", name)(config, options)
                         for name, options in config.features]
        for feature in self.features:
            feature.setup_runner(self)
        if self.is_cuda:
            torch.cuda.set_device(rank)
        self.device = torch.device("cuda", rank) if self.is_cuda else torch.device("cpu")
        self.head_dim = config.model_class.head_dim(hf_config)
        kv_heads = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
        self.num_kv_heads = kv_heads // config.tensor_parallel_size
        with self.building():
            self._load_and_prepare(hf_config)

    @contextlib.contextmanager
    def building(self):
        with _BUILD_LOCK, torch.device(self.device):
            default_dtype = torch.get_default_dtype()
            torch.set_default_dtype(self.config.torch_dtype)
            try:
                yield
            finally:
                torch.set_default_dtype(default_dtype)

    def _load_and_prepare(self, hf_config):
        config = self.config
        with contextlib.ExitStack() as stack:
            stack.enter_context(tensor_parallel(self.rank, config.tensor_parallel_size, self.group))
            for context in self.build_contexts:
                stack.enter_context(context())
            self.model = config.model_class(hf_config, max_model_len=config.max_model_len)
        for function in self.after_build:
            function(self.model)
        if config.load_format == "dummy":
            load_dummy_weights(self.model, config.seed + self.rank)
        else:
            load_model(self.model, config.model)
        self.sampler = Sampler(config.seed)
        self.sampling = SamplingPreparer(self.device, hf_config.vocab_size, config.eos_token_ids)
        self.generator = torch.Generator(self.device).manual_seed(config.seed)
        self.attention_backend = bind_backend(config.attention_backend, config.torch_dtype,
                                              self.head_dim)
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        for layer in self.attention_layers:
            layer.backend = self.attention_backend
        scaled = sum(m.k_scale != 1.0 or m.v_scale != 1.0 for m in self.attention_layers)
        if scaled and self.kv_dtype != torch.float8_e4m3fn and self.rank == 0:
            logger.info("the KV-cache scales of %d layers are unused: kv_cache_dtype=%r is not fp8",
                        scaled, config.kv_cache_dtype)
        if self.is_cuda:
            warmup_model(self)
        self.allocate_kv_cache()
        if self.is_cuda and not config.enforce_eager:
            self.capture_cudagraph()

    def capture_cudagraph(self):
        max_num_blocks = (self.max_model_len + self.block_size - 1) // self.block_size
        self.graphs = DecodeGraphs(self.model, min(self.config.max_num_seqs, 512), max_num_blocks,
                                   self.config.hf_config.hidden_size, self.building)

    def exit(self):  # frees graphs, KV cache, weights (unusable after) for another engine's sizing
        if self.is_cuda:  # a step may still be in flight (async scheduling)
            torch.cuda.synchronize()
        for layer in self.attention_layers:
            layer.k_cache = layer.v_cache = torch.tensor([])
        self.graphs, self.kv_cache, self.model, self.attention_layers = None, None, None, []
        for extension in self.extensions.values():  # a profiler stops (and writes its trace)
            getattr(extension, "close", lambda: None)()
        self.extensions.clear()  # lets go of what they hold (a host copy of the weights)
        gc.collect()  # each parameter and its layer form a cycle (the bound weight_loader)
        if self.is_cuda:
            torch.cuda.empty_cache()

    def _block_bytes(self) -> int:
        return (2 * len(self.attention_layers) * self.block_size * self.num_kv_heads
                * self.head_dim * self.kv_dtype.itemsize)

    def allocate_kv_cache(self):
        config, block_bytes = self.config, self._block_bytes()
        if config.num_kvcache_blocks > 0:
            num_blocks = config.num_kvcache_blocks
        elif self.is_cuda:  # what is left under the utilization cap after the warmup's peak
            (free, total), stats = torch.cuda.mem_get_info(), torch.cuda.memory_stats()
            peak, current = stats["allocated_bytes.all.peak"], stats["allocated_bytes.all.current"]
            budget = total * config.gpu_memory_utilization - (total - free) - peak + current
            num_blocks = int(budget) // block_bytes
        else:  # cpu_kvcache_space GiB, but no more than max_num_seqs full-length sequences
            budget = int(config.cpu_kvcache_space * 2 ** 30) // block_bytes
            blocks_per_seq = (config.max_model_len + self.block_size - 1) // self.block_size
            num_blocks = min(budget, config.max_num_seqs * blocks_per_seq)
        if self.group is not None:  # every rank must hold the same number of blocks
            t = torch.tensor([num_blocks], device=self.device)
            num_blocks = int(self.group.all_reduce(t, dist.ReduceOp.MIN).item())
        if num_blocks <= 0:
            remedy = "gpu_memory_utilization" if self.is_cuda else "cpu_kvcache_space"
            raise ValueError(f"no memory left for the KV cache ({block_bytes} bytes per block, got "
                             f"{num_blocks} blocks): raise {remedy} or set num_kvcache_blocks")
        self.num_kvcache_blocks = num_blocks
        self.max_model_len = min(config.max_model_len, num_blocks * self.block_size)
        if self.max_model_len < config.max_model_len and self.rank == 0:
            logger.warning("max_model_len lowered from %d to %d: the KV cache holds %d blocks of "
                           "%d tokens", config.max_model_len, self.max_model_len, num_blocks,
                           self.block_size)
        try:  # zeros: masked-out positions must not hold NaN bit patterns
            self.kv_cache = torch.zeros(2, len(self.attention_layers), num_blocks, self.block_size,
                                        self.num_kv_heads, self.head_dim, dtype=self.kv_dtype,
                                        device=self.device)
        except (RuntimeError, MemoryError) as e:  # torch.OutOfMemoryError is a RuntimeError
            raise ValueError(f"cannot allocate a KV cache of {num_blocks} blocks on {self.device}: "
                             "lower num_kvcache_blocks") from e
        for layer_id, layer in enumerate(self.attention_layers):
            layer.k_cache, layer.v_cache = self.kv_cache[0, layer_id], self.kv_cache[1, layer_id]

    def _to_device(self, values) -> torch.Tensor | None:
        return None if values is None else self.sampling.to_device(values)

    def step_tensors(self, step: StepInput) -> tuple[torch.Tensor, torch.Tensor, dict]:
        arrays = ("slot_mapping", "block_tables", "cu_seqlens_q", "cu_seqlens_k", "logits_indices",
                  "context_lens")
        context = {name: self._to_device(getattr(step, name)) for name in arrays}
        context.update(max_seqlen_q=step.max_seqlen_q, max_seqlen_k=step.max_seqlen_k)
        if step.prefix_groups is not None:  # decode: shared prefixes read once
            context["prefixes"] = step.prefix_groups.on_device(self._to_device)
        input_ids = self._to_device(step.input_ids)
        if step.prev_rows is not None:  # rows >= 0: their tokens are still on the device
            rows = self._to_device(step.prev_rows)
            input_ids = torch.where(rows >= 0, self.prev_sampled[rows.clamp(min=0)], input_ids)
        return input_ids, self._to_device(step.positions), context

    def prepare_sample(self, batch: SchedulerOutput) -> SamplingInputs:
        return self.sampling.prepare(batch)

    @torch.inference_mode()
    def run_model(self, input_ids: torch.Tensor, positions: torch.Tensor, is_prefill: bool):
        if is_prefill or self.graphs is None or input_ids.size(0) > self.graphs.max_batch_size:
            return self.model.compute_logits(self.model(input_ids, positions))
        return self.model.compute_logits(self.graphs.replay(input_ids, positions, get_context()))

    def run(self, step: StepInput, sampling: SamplingInputs | None = None):
        """One forward and its sampling: rank 0 gets a ``ModelRunnerOutput``, the others None."""
        return self.sample(step, self.forward(step, sampling), sampling)

    @torch.inference_mode()
    def forward(self, step: StepInput, sampling: SamplingInputs | None = None) -> tuple | None:
        """Rank 0 gets (logits to sample, prompt logprobs or None); ``sample`` follows: in between,
        rank 0 can build a grammar bitmask while the device runs."""
        input_ids, positions, context = self.step_tensors(step)
        with set_context(step.is_prefill, **context):
            logits = self.run_model(input_ids, positions, step.is_prefill)
        if self.rank != 0:
            return None
        if (prompt := sampling.prompt) is None:
            return logits, None
        prompt_lps = prompt_logprobs(logits, prompt.rows, prompt.target_ids, prompt.num_top)
        return logits[prompt.sample_rows], prompt_lps  # each sequence's last row

    @torch.inference_mode()
    def sample(self, step: StepInput, forward: tuple | None,
               sampling: SamplingInputs | None = None):
        token_ids = logprobs = None
        if self.rank == 0:  # forward: (logits, prompt logprobs)
            token_ids, logprobs = self.sampler(forward[0], sampling.batch, self.generator)
        if self.config.async_scheduling:
            if self.group is not None:
                if self.rank != 0:
                    token_ids = torch.empty(step.num_seqs, dtype=torch.int64, device=self.device)
                self.group.broadcast(token_ids, 0)
            self.prev_sampled = token_ids.clamp(min=0)  # -1 (not finite: ended) is no input
        if self.rank == 0:
            return ModelRunnerOutput(token_ids, logprobs, sampling.num_logprobs, sampling.prompt,
                                     forward[1], sampling.host_work)
