"""Data parallelism on a local Ray cluster: two CPU actors each holding a tiny model."""
from __future__ import annotations

import pytest
from conftest import CPU_ENGINE, random_prompts

ray = pytest.importorskip("ray")

from nanovllm import LLM, SamplingParams  # noqa: E402
from nanovllm.distributed.ray import DataParallelLLM, LLMPredictor  # noqa: E402

SP = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def reference(tiny):
    prompts = random_prompts(48, 3, 40, seed=80)
    llm = LLM(tiny, **CPU_ENGINE)
    try:
        return prompts, [o["token_ids"] for o in llm.generate(prompts, SP, use_tqdm=False)]
    finally:
        llm.exit()


def test_two_actors_equal_one_engine(local_ray, tiny, reference):
    prompts, expected = reference
    dp = DataParallelLLM(tiny, num_replicas=2, **CPU_ENGINE)
    try:
        outputs = dp.generate(prompts, SP, chunk_size=5, use_tqdm=False)
    finally:
        dp.shutdown()
    assert [o["token_ids"] for o in outputs] == expected


def test_a_killed_actor_loses_no_prompt(local_ray, tiny, reference):
    prompts, expected = reference
    dp = DataParallelLLM(tiny, num_replicas=2, **CPU_ENGINE)
    victim = dp.actors[0]
    ray.get([a.generate.remote([[1, 2]], [SP]) for a in dp.actors])  # both engines up
    # killed for certain before generate hands it a chunk (a timer raced the whole generate on a
    # fast machine): its first chunk fails and must go to the other actor
    ray.kill(victim)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(victim.generate.remote([[1, 2]], [SP]))
    try:
        outputs = dp.generate(prompts * 4, SP, chunk_size=4, use_tqdm=False)
    finally:
        dp.shutdown()
    assert dp.retries >= 1 and victim not in dp.actors
    assert [o["token_ids"] for o in outputs] == expected * 4


def test_ray_data_map_batches(local_ray, tiny, reference):
    prompts, expected = reference
    ds = ray.data.from_items([{"prompt": p} for p in prompts[:12]])
    out = ds.map_batches(LLMPredictor,
                         fn_constructor_kwargs={"model": tiny, "sampling_params": SP, **CPU_ENGINE},
                         concurrency=1, batch_size=6).take_all()
    got = {tuple(r["prompt"]): list(r["generated_token_ids"]) for r in out}
    assert [got[tuple(p)] for p in prompts[:12]] == expected[:12]
