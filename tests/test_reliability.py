"""Failures and exhaustion: dead workers, Ctrl-C, a killed run, a batch far larger than the cache, a soak."""
from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from conftest import assert_no_leaks, random_prompts

from nanovllm import LLM, SamplingParams

ENGINE = dict(kvcache_block_size=16, max_model_len=512, num_kvcache_blocks=256, device="cpu")


def _gone(pid: int, within: float = 10.0) -> bool:
    deadline = time.time() + within
    while time.time() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        try:  # reap it if it is our zombie child
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
        time.sleep(0.1)
    return False


def _shm(name: str) -> bool:
    return os.path.exists(f"/dev/shm/{name}")


def test_dead_worker_raises_naming_the_rank(tiny):
    llm = LLM(tiny, tensor_parallel_size=2, **ENGINE)
    worker = llm.workers.processes[0]
    shm_name = llm.workers.channel.shm.name
    threading.Timer(1.5, os.kill, (worker.pid, signal.SIGKILL)).start()
    start = time.time()
    with pytest.raises(RuntimeError, match=r"worker rank 1 died \(exit code -9\)"):
        llm.generate([[1] * 20] * 8, SamplingParams(max_tokens=450, ignore_eos=True), use_tqdm=False)
    assert time.time() - start < 30
    assert not worker.is_alive() and not _shm(shm_name)
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate([[1, 2]], SamplingParams(max_tokens=2), use_tqdm=False)
    llm.exit()  # a second exit is harmless


def test_waiting_for_a_step_notices_a_dead_worker():
    """With NCCL a step whose collectives wait for a dead rank never completes: the wait for its sampled
    tokens polls the step's event and gives up once a worker is gone, instead of blocking forever."""
    from nanovllm.engine.model_runner import wait_for_event

    class NeverDone:  # a CUDA event of a forward stuck in a collective
        def query(self):
            return False

        def synchronize(self):
            raise AssertionError("a blocking wait would never return")

    checks = []
    start = time.time()
    with pytest.raises(RuntimeError, match="worker died"):
        wait_for_event(NeverDone(), alive=lambda: checks.append(1) or len(checks) < 3, check_every_s=0.01)
    assert len(checks) == 3 and time.time() - start < 2

    class DoneAfter:  # a step that completes: no liveness check needed before it does
        def __init__(self, n):
            self.n = n

        def query(self):
            self.n -= 1
            return self.n <= 0

    wait_for_event(DoneAfter(5), alive=lambda: False, check_every_s=10.0)


SCRIPT = textwrap.dedent("""
    import sys
    from nanovllm import LLM, SamplingParams
    if __name__ == "__main__":
        llm = LLM(sys.argv[1], tensor_parallel_size=2, kvcache_block_size=16, max_model_len=512,
                  num_kvcache_blocks=256, device="cpu")
        print("PIDS", *[p.pid for p in llm.workers.processes], "SHM", llm.workers.channel.shm.name, flush=True)
        llm.generate([[1] * 20] * 8, SamplingParams(max_tokens=450, ignore_eos=True), use_tqdm=False)
        print("FINISHED", flush=True)
""")


def _start(tiny, tmp_path):
    script = tmp_path / "run.py"
    script.write_text(SCRIPT)
    proc = subprocess.Popen([sys.executable, str(script), tiny], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    line = proc.stdout.readline().split()
    assert line and line[0] == "PIDS", proc.stderr.read()[-2000:]
    return proc, [int(p) for p in line[1:line.index("SHM")]], line[-1]


def test_ctrl_c_shuts_everything_down(tiny, tmp_path):
    proc, workers, shm_name = _start(tiny, tmp_path)
    time.sleep(1.5)
    proc.send_signal(signal.SIGINT)  # to the main process only, as a supervisor would
    _, err = proc.communicate(timeout=30)
    assert proc.returncode != 0 and "KeyboardInterrupt" in err
    assert all(_gone(pid) for pid in workers), "orphan worker processes"
    assert not _shm(shm_name), "leaked shared memory"


def test_killed_run_leaves_nothing_that_blocks_the_next(tiny, tmp_path):
    proc, workers, shm_name = _start(tiny, tmp_path)
    time.sleep(1.5)
    proc.kill()  # SIGKILL: no cleanup code runs in the main process
    proc.wait(timeout=10)
    assert all(_gone(pid) for pid in workers), "workers outlived their rank 0"
    llm = LLM(tiny, tensor_parallel_size=2, **ENGINE)  # starts; any segment left behind is removed
    try:
        assert not _shm(shm_name)
        assert len(llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3), use_tqdm=False)[0]["token_ids"]) <= 3
    finally:
        llm.exit()


def test_batch_far_larger_than_the_cache(tiny):
    """2,000 requests through a cache that holds about 12 of them: every one completes, and greedy
    outputs equal those of an engine with room for all."""
    prompts = random_prompts(2000, 2, 30, seed=50)
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    small = LLM(tiny, kvcache_block_size=16, max_model_len=512, num_kvcache_blocks=24, device="cpu")
    try:
        out = small.generate(prompts, sp, use_tqdm=False)
        assert_no_leaks(small)
    finally:
        small.exit()
    big = LLM(tiny, **{**ENGINE, "num_kvcache_blocks": 4096})
    try:
        ref = big.generate(prompts[::20], sp, use_tqdm=False)
    finally:
        big.exit()
    assert all(len(o["token_ids"]) == 6 for o in out)
    assert [o["token_ids"] for o in out[::20]] == [r["token_ids"] for r in ref]


@pytest.mark.slow
def test_soak_ten_thousand_requests(tiny):
    """10,000 requests (mixed lengths, shared prefixes, cache pressure) in 5 waves through one engine:
    all complete with the right lengths, no blocks leak, and neither Python objects nor the prefix map grow."""
    llm = LLM(tiny, kvcache_block_size=16, max_model_len=512, num_kvcache_blocks=64, max_num_seqs=128, device="cpu")
    bm = llm.scheduler.block_manager
    shared = random_prompts(4, 40, 40, seed=60)
    objects = []
    try:
        for wave in range(5):
            tails = random_prompts(2000, 1, 30, seed=61 + wave)
            prompts = [shared[i % 4] + t if i % 2 else t for i, t in enumerate(tails)]
            params = [SamplingParams(temperature=0.0 if i % 3 else 0.8, max_tokens=1 + i % 5, ignore_eos=True)
                      for i in range(len(prompts))]
            out = llm.generate(prompts, params, use_tqdm=False)
            assert [len(o["token_ids"]) for o in out] == [sp.max_tokens for sp in params]
            assert_no_leaks(llm)
            assert len(bm.hash_to_block_id) <= len(bm.blocks) and not llm.requests
            del out
            gc.collect()
            objects.append(len(gc.get_objects()))
    finally:
        llm.exit()
    assert bm.num_cache_hits > 1000
    assert max(objects[1:]) - min(objects[1:]) < 2000, objects  # flat after the first wave
