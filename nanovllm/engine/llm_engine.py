"""The engine: tokenizer, requests, the step loop, and the tensor-parallel worker processes."""
from __future__ import annotations

import atexit
import json
import os
import socket
import uuid
from dataclasses import dataclass
from time import perf_counter

import torch.multiprocessing as mp
from tqdm.auto import tqdm
from transformers import AutoTokenizer

from nanovllm.config import Config
from nanovllm.engine.model_runner import ModelRunner
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import Sequence
from nanovllm.sampling_params import SamplingParams


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _eos_token_ids(config: Config, tokenizer) -> tuple[int, ...]:
    """Every EOS id of the checkpoint: generation_config.json's (else config.json's; one or a list)
    and the tokenizer's."""
    ids: set[int] = set()
    path = os.path.join(config.model, "generation_config.json")
    eos = getattr(config.hf_config, "eos_token_id", None)
    if os.path.isfile(path):
        with open(path) as f:
            eos = json.load(f).get("eos_token_id", eos)
    ids.update([eos] if isinstance(eos, int) else eos or [])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))


@dataclass
class _Throughput:
    prefill: float = 0.0
    decode: float = 0.0


class LLMEngine:
    def __init__(self, model: str, **kwargs):
        config = Config.from_kwargs(model, **kwargs)
        self.config = config
        self.tokenizer = None if config.skip_tokenizer_init else AutoTokenizer.from_pretrained(config.model)
        config.eos_token_ids = _eos_token_ids(config, self.tokenizer)
        self.ps: list[mp.Process] = []
        self.events = []
        shm_name, port = f"nanovllm-{os.getpid()}-{uuid.uuid4().hex[:12]}", _free_port()
        ctx = mp.get_context("spawn")
        for rank in range(1, config.tensor_parallel_size):
            event = ctx.Event()
            process = ctx.Process(target=ModelRunner, args=(config, rank, event, shm_name, port), daemon=True)
            process.start()
            self.ps.append(process)
            self.events.append(event)
        try:
            self.model_runner = ModelRunner(config, 0, self.events, shm_name, port)
        except BaseException:
            for p in self.ps:  # the workers would wait for rank 0 forever
                p.kill()
            raise
        config.num_kvcache_blocks = self.model_runner.num_kvcache_blocks
        self.scheduler = Scheduler(config)
        self._closed = False
        atexit.register(self.exit)

    def exit(self):
        if self._closed:
            return
        self._closed = True
        self.model_runner.call("exit")
        del self.model_runner
        for p in self.ps:
            p.join()
        atexit.unregister(self.exit)

    # ---- requests ------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], sampling_params: SamplingParams):
        if isinstance(prompt, str):
            prompt = self._encode(prompt)
        seq = Sequence(prompt, sampling_params, self.config.kvcache_block_size)
        self.scheduler.add(seq)
        return seq

    def step(self) -> tuple[list[tuple[int, list[int]]], int]:
        """One forward. Returns the sequences that finished, as (seq_id, completion token ids),
        and the number of tokens processed (positive: prefill tokens; negative: decoded sequences)."""
        seqs, is_prefill = self.scheduler.schedule()
        num_tokens = sum(seq.num_scheduled_tokens for seq in seqs) if is_prefill else -len(seqs)
        token_ids = self.model_runner.call("run", seqs, is_prefill)
        self.scheduler.postprocess(seqs, token_ids)
        outputs = [(seq.seq_id, seq.completion_token_ids) for seq in seqs if seq.is_finished]
        return outputs, num_tokens

    def is_finished(self) -> bool:
        return self.scheduler.is_finished()

    def generate(self, prompts: list[str] | list[list[int]], sampling_params: SamplingParams | list[SamplingParams],
                 use_tqdm: bool = True) -> list[dict]:
        """Completions of ``prompts``, in prompt order: dicts with ``text`` and ``token_ids``."""
        prompts, params = self._validate(prompts, sampling_params)
        seq_ids = [self.add_request(p, sp).seq_id for p, sp in zip(prompts, params)]
        pbar = tqdm(total=len(prompts), desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
        outputs, throughput = {}, _Throughput()
        while not self.is_finished():
            t = perf_counter()
            finished, num_tokens = self.step()
            elapsed = perf_counter() - t
            if num_tokens > 0:
                throughput.prefill = num_tokens / elapsed
            else:
                throughput.decode = -num_tokens / elapsed
            pbar.set_postfix(prefill=f"{throughput.prefill:.0f}tok/s", decode=f"{throughput.decode:.0f}tok/s",
                             refresh=False)
            for seq_id, token_ids in finished:
                outputs[seq_id] = token_ids
                pbar.update(1)
        pbar.close()
        return [{"text": self._decode(outputs[i]), "token_ids": outputs[i]} for i in seq_ids]

    def _encode(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("string prompts need a tokenizer, but the engine has skip_tokenizer_init=True: "
                             "pass token ids")
        return self.tokenizer.encode(prompt)

    def _decode(self, token_ids: list[int]) -> str:
        """The text of a completion, without special tokens (vLLM's default); "" without a tokenizer."""
        return "" if self.tokenizer is None else self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def _validate(self, prompts, sampling_params):
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise TypeError(f"prompts must be a list of strings or of token-id lists, got {type(prompts).__name__}")
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if not isinstance(sampling_params, (list, tuple)) or \
                not all(isinstance(sp, SamplingParams) for sp in sampling_params):
            raise TypeError("sampling_params must be a SamplingParams or a list of them, one per prompt")
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(sampling_params)} sampling params")
        vocab_size = self.config.hf_config.vocab_size
        checked = []
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                prompt = self._encode(prompt)
            elif not isinstance(prompt, (list, tuple)) or not all(type(t) is int for t in prompt):
                raise TypeError(f"prompt {i} must be a string or a list of ints, got {prompt!r:.80}")
            if not prompt:
                raise ValueError(f"prompt {i} is empty")
            if bad := [t for t in prompt if not 0 <= t < vocab_size]:
                raise ValueError(f"prompt {i} has token ids {bad[:5]} outside the vocabulary [0, {vocab_size})")
            self._check_fits(i, len(prompt))
            checked.append(list(prompt))
        return checked, sampling_params

    def _check_fits(self, i: int, num_tokens: int):
        config = self.config
        if num_tokens >= config.max_model_len:
            raise ValueError(f"prompt {i} has {num_tokens} tokens; max_model_len={config.max_model_len} "
                             "leaves no room for output")
        capacity = config.num_kvcache_blocks * config.kvcache_block_size
        if num_tokens + 1 > capacity:
            raise ValueError(f"prompt {i} has {num_tokens} tokens but the whole KV cache holds {capacity} "
                             f"({config.num_kvcache_blocks} blocks of {config.kvcache_block_size})")
