"""Data parallelism on Ray, a feature: ``DataParallelLLM`` spreads prompts in chunks over engine
actors (a dead actor's chunk retried on another); ``LLMPredictor`` serves Ray Data's
``Dataset.map_batches``. Both build ``engine_class`` engines (``nanovllm.distributed.ray`` binds
vLLM's ``LLM``)."""
from __future__ import annotations

import ray
from ray.exceptions import RayActorError
from tqdm.auto import tqdm

from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.outputs import RequestOutput
from nanovllm.sampling_params import SamplingParams


class DataParallelLLM:
    """``num_replicas`` engines as Ray actors; ``generate`` has ``LLM.generate``'s signature."""

    engine_class: type = LLMEngine

    def __init__(self, model: str, num_replicas: int | None = None, **engine_kwargs):
        if not ray.is_initialized():
            ray.init()
        tp = engine_kwargs.get("tensor_parallel_size", 1)
        gpus = int(ray.cluster_resources().get("GPU", 0))
        on_gpu = gpus > 0 and engine_kwargs.get("device", "auto") != "cpu"
        if num_replicas is None:
            num_replicas = max(1, gpus // tp) if on_gpu else 1
        if not isinstance(num_replicas, int) or num_replicas < 1:
            raise ValueError(f"num_replicas must be a positive int, got {num_replicas!r}")
        options = {"num_gpus": tp} if on_gpu else {"num_cpus": 1}
        actor = ray.remote(self.engine_class)
        self.actors = [actor.options(**options).remote(model, **engine_kwargs)
                       for _ in range(num_replicas)]
        self.retries = 0  # chunks retried after their actor died

    def generate(self, prompts: list,
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 chunk_size: int = 256, use_tqdm: bool = True) -> list[RequestOutput]:
        params = sampling_params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params")
        todo = [range(i, min(i + chunk_size, len(prompts)))
                for i in range(0, len(prompts), chunk_size)][::-1]
        idle, running = list(self.actors), {}
        outputs: list[RequestOutput | None] = [None] * len(prompts)
        with tqdm(total=len(prompts), desc="Generating", disable=not use_tqdm) as pbar:
            while todo or running:
                while todo and idle:
                    actor, chunk = idle.pop(), todo.pop()
                    ref = actor.generate.remote([prompts[i] for i in chunk],
                                                [params[i] for i in chunk], use_tqdm=False)
                    running[ref] = (actor, chunk)
                if not running:
                    raise RuntimeError("every engine actor has died")
                [ref], _ = ray.wait(list(running), num_returns=1)
                actor, chunk = running.pop(ref)
                try:
                    outputs[chunk.start:chunk.stop] = ray.get(ref)
                except RayActorError:  # its chunk goes back to the queue for another actor
                    self.actors.remove(actor)
                    todo.append(chunk)
                    self.retries += 1
                    continue
                idle.append(actor)
                pbar.update(len(chunk))
        return outputs

    def shutdown(self):
        for actor in self.actors:
            ray.kill(actor)
        self.actors = []


class LLMPredictor:
    """A ``Dataset.map_batches`` callable: reads "prompt", adds "generated_text" and
    "generated_token_ids"."""

    engine_class: type = LLMEngine

    def __init__(self, model: str, sampling_params: SamplingParams | None = None, **engine_kwargs):
        self.llm = self.engine_class(model, **engine_kwargs)
        self.sampling_params = sampling_params or SamplingParams()

    def __call__(self, batch: dict) -> dict:
        prompts = [p if isinstance(p, str) else [int(t) for t in p] for p in batch["prompt"]]
        outputs = self.llm.generate(prompts, self.sampling_params, use_tqdm=False)
        return {**batch, "generated_text": [o["text"] for o in outputs],
                "generated_token_ids": [o["token_ids"] for o in outputs]}
