"""Specification of the RL rollout surface: sleep mode (``sleep(level)``/``wake_up(tags)``: greedy
outputs after waking equal those before, at TP=1 and TP=2; memory really given back; requests
refused while asleep), ``worker_extension_cls`` with ``collective_rpc``, and sampled logprobs that
transformers recomputes on the updated weights."""
from __future__ import annotations

import pytest
import torch
from conftest import CPU_ENGINE, random_prompts, token_ids_of
from tiny_model import build_tiny_qwen3

from nanovllm import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = random_prompts(3, 20, 40, seed=7)
SLEEPY = dict(CPU_ENGINE, enable_sleep_mode=True)


class Extension:
    """A worker extension as vLLM's RLHF examples write one: methods that reach the model through
    ``self``."""

    def weight_sum(self) -> float:
        return float(sum(p.detach().double().sum() for p in self.model_runner.model.parameters()))

    def scale_norms(self, factor: float) -> int:
        """Scales every RMSNorm weight in place; the rank's number of scaled tensors."""
        norms = [p for name, p in self.model.named_parameters() if name.endswith("norm.weight")]
        with torch.no_grad():
            for p in norms:
                p.mul_(factor)
        return len(norms)


class Clashing:
    def capture_cudagraph(self):  # the runner's own
        pass


class ClashingWithAnInstanceAttribute:
    @property
    def device(self):  # the runner sets self.device in __init__
        return "mine"

    def model(self):  # and self.model
        pass


class WithInit:
    def __init__(self):
        self.x = 1


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("rl")
    return build_tiny_qwen3(str(root / "a"), seed=0), build_tiny_qwen3(str(root / "b"), seed=1)


def generate(llm: LLM) -> list[list[int]]:
    return token_ids_of(llm.generate(PROMPTS, GREEDY, use_tqdm=False))


def weight_bytes(llm: LLM) -> int:
    return sum(p.untyped_storage().nbytes() for p in llm.model_runner.model.parameters())


def sleep_cycle(llm: LLM, weights) -> list[list[int]]:
    """Level 1 and back, then level 2, weights woken and reloaded, then the KV cache: each time the
    outputs are the same as before sleeping; what is asleep is refused by name."""
    before = generate(llm)
    llm.sleep(level=1)
    assert llm.is_sleeping()
    assert weight_bytes(llm) == 0 and llm.model_runner.kv_cache.untyped_storage().nbytes() == 0
    with pytest.raises(RuntimeError,
                       match=r"a request while the engine sleeps \(weights and kv_cache asleep\)"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm.wake_up()
    assert not llm.is_sleeping()
    assert generate(llm) == before
    llm.sleep(level=2)
    with pytest.raises(RuntimeError,
                       match=r"update_weights\(\) while the engine sleeps.*tags=\['weights'\]"):
        llm.update_weights(weights)
    llm.wake_up(tags=["weights"])
    assert weight_bytes(llm) > 0 and llm.is_sleeping()
    llm.update_weights(weights)
    with pytest.raises(RuntimeError, match=r"kv_cache asleep\).*tags=\['kv_cache'\]"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm.wake_up(tags=["kv_cache"])
    assert generate(llm) == before
    return before


def test_sleep_and_wake_up_one_rank(pair, oracle):
    a, _ = pair
    weights = list(oracle.model(a).named_parameters())
    with LLM(a, **SLEEPY) as llm:
        ptrs = [p.data_ptr() for p in llm.model_runner.model.parameters()]
        sleep_cycle(llm, weights)
        assert generate(llm) == generate(llm)  # the prefix cache (reset at sleep) refilled and hit
        # a second sleep while asleep changes nothing (vLLM's): level 2 over level 1 keeps the
        # host copy, and the weights wake as they were
        before = generate(llm)
        llm.sleep(level=1)
        assert llm.model_runner.extensions["sleep"].host is not None
        llm.sleep(level=2)
        assert llm.model_runner.extensions["sleep"].host is not None
        llm.wake_up()
        assert generate(llm) == before
        llm.sleep(level=2)
        llm.wake_up()
        # discarded: zeros
        assert all(not p.detach().any() for p in llm.model_runner.model.parameters())
        llm.update_weights(weights)
        assert len(ptrs) == len(list(llm.model_runner.model.parameters()))
        with pytest.raises(ValueError, match="level must be"):
            llm.sleep(level=3)
        with pytest.raises(ValueError, match=r"unknown tag\(s\) \['weight'\]"):
            llm.wake_up(tags=["weight"])
        with pytest.raises(TypeError, match="tags must be None or a list"):
            llm.wake_up(tags="weights")
        request = llm.add_request(PROMPTS[0], GREEDY)
        llm.step()
        with pytest.raises(ValueError, match="sleep\\(\\) while 1 completions are unfinished"):
            llm.sleep()
        llm.abort_request(request)
    with LLM(a, **CPU_ENGINE) as llm:
        with pytest.raises(ValueError, match="enable_sleep_mode=True"):
            llm.sleep()


def test_sleep_and_extension_on_two_ranks(pair, oracle, monkeypatch):
    """TP=2: sleep and wake_up run on both ranks (the update after level 2 reaches the worker's
    shard), and the extension's methods run on each with the runner as ``self``. The updates take
    CUDA's route here: the worker gets the tensors by a broadcast over the TP group (gloo on CPU),
    not through the call channel."""
    from nanovllm.features import weight_update
    monkeypatch.setattr(weight_update, "BROADCAST_DEVICES", ("cuda", "cpu"))
    a, b = pair
    with LLM(a, **SLEEPY, tensor_parallel_size=2,
             worker_extension_cls=f"{__name__}.Extension") as llm:
        sleep_cycle(llm, list(oracle.model(a).named_parameters()))
        sums = llm.collective_rpc("weight_sum")
        assert len(sums) == 2 and sums[0] != sums[1]  # each rank holds its own shards
        llm.update_weights(list(oracle.model(b).named_parameters()))
        assert all(x != y for x, y in zip(llm.collective_rpc("weight_sum"), sums))
        # 2 layers x 4 norms + the final one
        assert llm.collective_rpc("scale_norms", args=(1.0,)) == [9, 9]
        llm.sleep(level=1)
        assert llm.collective_rpc(lambda_free_storage) == [0, 0]  # every rank gave its weights back
        llm.wake_up()
        expected = LLM(b, **CPU_ENGINE)
        try:
            assert generate(llm) == generate(expected)
        finally:
            expected.exit()


def lambda_free_storage(runner) -> int:
    return sum(p.untyped_storage().nbytes() for p in runner.model.parameters())


def test_worker_extension_cls_one_rank(pair):
    with LLM(pair[0], **CPU_ENGINE, worker_extension_cls=Extension) as llm:
        before = generate(llm)
        total = llm.collective_rpc("weight_sum")[0]
        assert total == pytest.approx(Extension.weight_sum(llm.model_runner.worker))
        assert llm.collective_rpc("scale_norms", kwargs={"factor": 0.0}) == [9]
        assert generate(llm) != before  # the extension changed the model
    with pytest.raises(ValueError,
                       match=r"worker_extension_cls='no.such.Class' cannot be imported"):
        LLM(pair[0], **CPU_ENGINE, worker_extension_cls="no.such.Class")
    with pytest.raises(TypeError, match="worker_extension_cls must be a class"):
        LLM(pair[0], **CPU_ENGINE, worker_extension_cls=3)
    with pytest.raises(ValueError,
                       match=r"Clashing: attribute\(s\) \['capture_cudagraph'\] conflict"):
        LLM(pair[0], **CPU_ENGINE, worker_extension_cls=Clashing)
    with pytest.raises(ValueError, match="WithInit defines __init__"):
        LLM(pair[0], **CPU_ENGINE, worker_extension_cls=WithInit)
    with pytest.raises(ValueError, match=r"ClashingWithAnInstanceAttribute: attribute\(s\) "
                                         r"\['device', 'model'\] conflict"):
        LLM(pair[0], **CPU_ENGINE, worker_extension_cls=ClashingWithAnInstanceAttribute)


def test_sampled_logprobs_match_transformers_after_update(pair, oracle):
    """After ``update_weights`` with B's weights, temperature-1 samples' logprobs equal
    transformers' log_softmax of B's raw logits at each sampled token (fp32, CPU)."""
    a, b = pair
    model = oracle.model(b)
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=10, logprobs=0, ignore_eos=True,
                            n=2)
    with LLM(a, **CPU_ENGINE) as llm:
        llm.update_weights(model.named_parameters())
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    compared = 0
    for prompt, output in zip(PROMPTS, outputs):
        for completion in output.outputs:
            ids = list(prompt) + list(completion.token_ids)
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits[0, len(prompt) - 1:-1].float()
            expected = torch.log_softmax(logits, -1).gather(
                1, torch.tensor(completion.token_ids)[:, None])[:, 0]
            got = torch.tensor([float(entry[token]) for entry, token in zip(completion.logprobs,
                                                                             completion.token_ids)])
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
            compared += len(got)
    assert compared == len(PROMPTS) * 2 * 10


@pytest.mark.gpu
def test_sleep_gives_device_memory_back_and_graphs_are_captured_again(pair, oracle):
    """CUDA: sleep(level=1) frees at least the weights and the KV cache (the device's used memory
    falls by 90% of their bytes or more); after wake_up the decode graphs are captured again and the
    outputs are as before."""
    a, _ = pair
    with LLM(a, kvcache_block_size=16, max_model_len=512, num_kvcache_blocks=4096,
             enable_sleep_mode=True, max_num_seqs=8) as llm:
        runner = llm.model_runner
        assert runner.graphs is not None
        before = generate(llm)
        held = weight_bytes(llm) + runner.kv_cache.untyped_storage().nbytes()
        torch.cuda.synchronize()
        used = torch.cuda.mem_get_info()[1] - torch.cuda.mem_get_info()[0]
        llm.sleep(level=1)
        freed = used - (torch.cuda.mem_get_info()[1] - torch.cuda.mem_get_info()[0])
        assert freed >= 0.9 * held, (freed, held)
        assert runner.graphs is None
        llm.wake_up()
        assert runner.graphs is not None
        assert generate(llm) == before
