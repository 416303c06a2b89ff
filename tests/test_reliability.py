"""Specification of failures and resource hygiene: dead workers, Ctrl-C, a killed run, orphan
processes, shared memory, engines that fail to start, a failure that is one request's own, memory
given back when an engine is dropped, threads, a batch far larger than the cache, a soak."""
from __future__ import annotations

import _thread
import gc
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import weakref

import pytest
import torch
from conftest import (
    CPU_ENGINE,
    ENGINE,
    GREEDY,
    assert_no_leaks,
    edited_checkpoint,
    random_prompts,
    token_ids_of,
)

from nanovllm import LLM, SamplingParams
from nanovllm.engine import worker_group
from nanovllm.engine.worker_group import WorkerDiedError


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


# ---- dead workers, orphans, shared memory --------------------------------------------------------
@pytest.mark.parametrize("delay", [0.3, 1.0, 1.8])
def test_dead_worker_raises_naming_the_rank(tiny, delay):
    """Killed at any point of a generate, the worker is named (never gloo's raw 'Connection
    reset')."""
    llm = LLM(tiny, tensor_parallel_size=2, **CPU_ENGINE)
    worker = llm.workers.processes[0]
    shm_name = llm.workers.channel.shm.name
    threading.Timer(delay, os.kill, (worker.pid, signal.SIGKILL)).start()
    start = time.time()
    with pytest.raises(WorkerDiedError, match=r"worker rank 1 died \(exit code -9\)"):
        llm.generate([[1] * 20] * 8, SamplingParams(max_tokens=450, ignore_eos=True),
                     use_tqdm=False)
    assert time.time() - start < 30
    assert not worker.is_alive() and not _shm(shm_name)
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate([[1, 2]], SamplingParams(max_tokens=2), use_tqdm=False)
    llm.exit()  # a second exit is harmless


def _in_thread(fn, timeout: float):
    """(result, exception) of fn() run in a thread, or pytest.fail if it has not returned by
    ``timeout``."""
    box = {}

    def run():
        try:
            box["result"] = fn()
        except BaseException as e:  # surfaced to the caller
            box["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        pytest.fail(f"still waiting after {timeout} s")
    return box.get("result"), box.get("error")


def test_idle_worker_killed_between_calls_is_named(tiny):
    llm = LLM(tiny, tensor_parallel_size=2, **CPU_ENGINE)
    try:
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3), use_tqdm=False)
        worker = llm.workers.processes[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(10)
        start = time.time()
        _, error = _in_thread(lambda: llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3),
                                                   use_tqdm=False), 60)
        assert (isinstance(error, WorkerDiedError)
                and "rank 1 died (exit code -9)" in str(error)), error
        assert time.time() - start < 10
    finally:
        llm.exit()


@pytest.fixture
def sigint_raises():
    """Ctrl-C raising KeyboardInterrupt, as in a terminal: a shell that starts pytest in the
    background ignores SIGINT, and Python then leaves it ignored (interrupt_main does nothing,
    children inherit it)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_ctrl_c_with_tensor_parallelism_returns_at_once(tiny, sigint_raises):
    llm = LLM(tiny, tensor_parallel_size=2, **CPU_ENGINE)
    workers = [p.pid for p in llm.workers.processes]
    interrupted = []

    def interrupt():
        interrupted.append(time.monotonic())
        _thread.interrupt_main()

    threading.Timer(1.0, interrupt).start()
    with pytest.raises(KeyboardInterrupt):
        llm.generate([[1] * 20] * 8, SamplingParams(max_tokens=450, ignore_eos=True),
                     use_tqdm=False)
    llm.exit()  # a no-op when the interrupt came inside a step (it shut the engine down then)
    took = time.monotonic() - interrupted[0]
    assert took < 5, f"Ctrl-C took {took:.1f} s to shut the engine down"
    assert all(_gone(pid, within=5) for pid in workers)


def test_two_tp_engines_side_by_side_and_after_a_failed_start(tiny, tmp_path):
    bad = edited_checkpoint(tiny, tmp_path / "bad", intermediate_size=lambda n: 2 * n)
    with pytest.raises(ValueError, match="checkpoint tensor"):
        LLM(bad, tensor_parallel_size=2, **CPU_ENGINE)
    prompts = random_prompts(6, 5, 40, seed=97)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with LLM(tiny, **CPU_ENGINE) as ref_engine:
        ref = [o["token_ids"] for o in ref_engine.generate(prompts, sp, use_tqdm=False)]
    a, b = (LLM(tiny, tensor_parallel_size=2, **CPU_ENGINE),
            LLM(tiny, tensor_parallel_size=2, **CPU_ENGINE))
    try:
        assert [o["token_ids"] for o in a.generate(prompts, sp, use_tqdm=False)] == ref
        assert [o["token_ids"] for o in b.generate(prompts, sp, use_tqdm=False)] == ref
    finally:
        a.exit()
        b.exit()


def test_a_call_larger_than_the_segment_moves_to_a_larger_one(tiny, monkeypatch):
    """Steps whose description exceeds the shared-memory segment (512 bytes here; 512 sequences of
    1,000 blocks exceed the 1 MiB default) move to a larger segment instead of failing."""
    monkeypatch.setattr(worker_group, "SEGMENT_SIZE", 512)
    prompts = random_prompts(24, 30, 90, seed=98)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with LLM(tiny, **CPU_ENGINE) as ref_engine:
        ref = [o["token_ids"] for o in ref_engine.generate(prompts, sp, use_tqdm=False)]
    with LLM(tiny, tensor_parallel_size=2, **CPU_ENGINE) as llm:
        first = llm.workers.channel.shm.name
        assert [o["token_ids"] for o in llm.generate(prompts, sp, use_tqdm=False)] == ref
        assert llm.workers.channel.moves >= 1 and llm.workers.channel.shm.size > 512
        assert not _shm(first)  # the old segment is unlinked once the workers have left it
        moved = llm.workers.channel.shm.name
    assert not _shm(moved)


def test_full_dev_shm_is_a_clear_error():
    stat = os.statvfs("/dev/shm")
    # more than /dev/shm holds: refused before any page
    too_big = stat.f_blocks * stat.f_frsize + 2 ** 20
    name = f"nanovllm-{os.getpid()}-fulltest"
    with pytest.raises(RuntimeError,
                       match=r"cannot reserve \d+ bytes of shared memory in /dev/shm"):
        worker_group.create_segment(name, too_big)
    assert not _shm(name)


def test_workers_exit_with_rank_0_whatever_their_main_thread_does(tmp_path):
    """A worker whose main thread is blocked (in a collective, a device sync, C code holding the
    GIL) still ends when rank 0's process is killed: a watchdog thread on the parent's sentinel, and
    the parent-death signal for a main thread that never releases the GIL."""
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent("""
        import multiprocessing, os, time
        from nanovllm.engine.worker_group import _exit_with_parent

        def sleeper():  # blocked, GIL released: the watchdog thread ends it
            _exit_with_parent(pdeathsig=False)
            print("READY", os.getpid(), flush=True)
            time.sleep(600)

        def spinner():  # blocked in C code that holds the GIL: only the signal can end it
            _exit_with_parent(pdeathsig=True)
            print("READY", os.getpid(), flush=True)
            sum(range(10 ** 13))

        if __name__ == "__main__":
            ctx = multiprocessing.get_context("spawn")
            children = [ctx.Process(target=f, daemon=True) for f in (sleeper, spinner)]
            for c in children:
                c.start()
            time.sleep(600)
    """))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    # each child says when it is set up (on a loaded machine, starting takes a while)
    pids = [int(proc.stdout.readline().split()[1]) for _ in range(2)]
    time.sleep(0.5)  # both are in their blocking call
    proc.kill()
    proc.wait(timeout=10)
    assert all(_gone(pid, within=20) for pid in pids), "a child outlived its parent"


def test_a_child_whose_parent_died_while_it_started_exits(tmp_path):
    """Rank 0 killed before a worker armed its watchdog (the worker still importing): the worker
    sees it has been re-parented and exits, even when its main thread would next hold the GIL for
    good."""
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent("""
        import multiprocessing, time
        from nanovllm.engine.worker_group import _exit_with_parent

        def late():                  # the parent dies during this sleep
            time.sleep(3)
            _exit_with_parent(pdeathsig=True)
            sum(range(10 ** 13))

        if __name__ == "__main__":
            child = multiprocessing.get_context("spawn").Process(target=late, daemon=True)
            child.start()
            print(child.pid, flush=True)
            time.sleep(600)
    """))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    pid = int(proc.stdout.readline())
    proc.kill()
    proc.wait(timeout=10)
    gone = _gone(pid, within=40)
    if not gone:
        os.kill(pid, signal.SIGKILL)
    assert gone, "a child that armed its watchdog after its parent died lived on"


def test_script_without_main_guard_fails_at_once_with_the_fix(tiny, tmp_path):
    script = tmp_path / "unguarded.py"
    script.write_text(textwrap.dedent(f"""
        from nanovllm import LLM
        llm = LLM({tiny!r}, tensor_parallel_size=2, kvcache_block_size=16, max_model_len=512,
                  num_kvcache_blocks=64, device="cpu")
        print("STARTED")
    """))
    start = time.time()
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode != 0 and "STARTED" not in proc.stdout
    assert ('if __name__ == "__main__":' in proc.stderr
            and "WorkerDiedError" in proc.stderr), proc.stderr[-3000:]
    assert time.time() - start < 120


def test_waiting_for_a_step_notices_a_dead_worker():
    """With NCCL a step whose collectives wait for a dead rank never completes: the wait for its
    sampled tokens polls the step's event and gives up once a worker is gone, instead of blocking
    forever."""
    from nanovllm.engine.cuda_graph import wait_for_event

    class NeverDone:  # a CUDA event of a forward stuck in a collective
        def query(self):
            return False

        def synchronize(self):
            raise AssertionError("a blocking wait would never return")

    checks = []
    start = time.time()
    with pytest.raises(RuntimeError, match="worker died"):
        wait_for_event(NeverDone(), alive=lambda: checks.append(1) or len(checks) < 3,
                       check_every_s=0.01)
    assert len(checks) == 3 and time.time() - start < 2

    class DoneAfter:  # a step that completes: no liveness check needed before it does
        def __init__(self, n):
            self.n = n

        def query(self):
            self.n -= 1
            return self.n <= 0

    wait_for_event(DoneAfter(5), alive=lambda: False, check_every_s=10.0)


# ---- Ctrl-C and a killed run ---------------------------------------------------------------------
SCRIPT = textwrap.dedent("""
    import signal, sys, time
    from nanovllm import LLM, SamplingParams
    if __name__ == "__main__":
        # whatever the test runner's shell ignores
        signal.signal(signal.SIGINT, signal.default_int_handler)
        llm = LLM(sys.argv[1], tensor_parallel_size=2, kvcache_block_size=16, max_model_len=512,
                  num_kvcache_blocks=256, device="cpu")
        print("PIDS", *[p.pid for p in llm.workers.processes], "SHM", llm.workers.channel.shm.name,
              flush=True)
        try:
            llm.generate([[1] * 20] * 8, SamplingParams(max_tokens=450, ignore_eos=True),
                         use_tqdm=False)
        except KeyboardInterrupt:
            llm.exit()
            print("SHUT DOWN", time.monotonic(), flush=True)
            raise
        print("FINISHED", flush=True)
""")


def _start(tiny, tmp_path):
    script = tmp_path / "run.py"
    script.write_text(SCRIPT)
    proc = subprocess.Popen([sys.executable, str(script), tiny], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline().split()
    assert line and line[0] == "PIDS", proc.stderr.read()[-2000:]
    return proc, [int(p) for p in line[1:line.index("SHM")]], line[-1]


def test_ctrl_c_shuts_everything_down(tiny, tmp_path):
    """Ctrl-C: the engine is shut down within seconds of the signal, however loaded the machine (the
    workers are killed, not waited for); the interpreter's own exit then gets a generous bound."""
    proc, workers, shm_name = _start(tiny, tmp_path)
    time.sleep(1.5)
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)  # to the main process only, as a supervisor would
    out, err = proc.communicate(timeout=120)
    assert proc.returncode != 0 and "KeyboardInterrupt" in err
    shut_down = [float(line.split()[-1])
                 for line in out.splitlines() if line.startswith("SHUT DOWN")]
    assert shut_down and shut_down[0] - sent < 10, (out, err[-2000:])
    assert all(_gone(pid) for pid in workers), "orphan worker processes"
    assert not _shm(shm_name), "leaked shared memory"


def test_killed_run_leaves_nothing_that_blocks_the_next(tiny, tmp_path):
    proc, workers, shm_name = _start(tiny, tmp_path)
    time.sleep(1.5)
    proc.kill()  # SIGKILL: no cleanup code runs in the main process
    proc.wait(timeout=10)
    assert all(_gone(pid) for pid in workers), "workers outlived their rank 0"
    # starts; any segment left behind is removed
    llm = LLM(tiny, tensor_parallel_size=2, **CPU_ENGINE)
    try:
        assert not _shm(shm_name)
        assert len(llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3),
                                use_tqdm=False)[0]["token_ids"]) <= 3
    finally:
        llm.exit()


# ---- failures that are one request's own, and a forward that raises ------------------------------
def test_a_failure_that_is_one_requests_own_ends_that_request(tiny):
    """A request whose text cannot be decoded (a tokenizer that raises on some id) ends with
    finish_reason "error"; the other requests, and the engine, go on."""
    llm = LLM(tiny, **ENGINE)
    try:
        good = random_prompts(2, 5, 20, seed=73)
        ref = token_ids_of(llm.generate(good, GREEDY, use_tqdm=False))
        mark = next(t for t in range(256) if all(t not in r + p for r, p in zip(ref, good)))
        tokenizer = llm.tokenizer

        class Faulty:
            def __getattr__(self, name):
                return getattr(tokenizer, name)

            def decode(self, ids, **kw):
                if mark in ids:
                    raise ValueError(f"cannot decode token {mark}")
                return tokenizer.decode(ids, **kw)

        llm.tokenizer = Faulty()
        sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop=["never-there"])
        out = llm.generate(good + [[1, 2, mark]], sp, use_tqdm=False)
        assert token_ids_of(out[:2]) == ref
        assert out[2]["finish_reason"] == "error" and "cannot decode token" in out[2]["error"]
        assert_no_leaks(llm)
        llm.tokenizer = tokenizer
        assert token_ids_of(llm.generate(good, GREEDY, use_tqdm=False)) == ref
    finally:
        llm.exit()


@pytest.mark.parametrize("first", [False, True], ids=["last", "first"])
def test_a_request_whose_sampling_inputs_fail_ends_alone(tiny, monkeypatch, first):
    """The failing request last or first in the batch (first: the rows after it must stay those of
    their own sequences)."""
    llm = LLM(tiny, **ENGINE)
    try:
        prompts = random_prompts(3, 5, 20, seed=74)
        ref = token_ids_of(llm.generate(prompts, GREEDY, use_tqdm=False))
        runner, original = llm.model_runner, llm.model_runner.prepare_sample
        poisoned = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, top_k=3)

        def prepare_sample(batch):
            if any(seq.sampling_params.top_k == 3 for seq in batch.seqs):
                raise RuntimeError("this request's sampling inputs cannot be built")
            return original(batch)

        monkeypatch.setattr(runner, "prepare_sample", prepare_sample)
        if first:
            out = llm.generate([[9, 9, 9]] + prompts, [poisoned] + [GREEDY] * 3, use_tqdm=False)
            out = out[1:] + out[:1]
        else:
            out = llm.generate(prompts + [[9, 9, 9]], [GREEDY] * 3 + [poisoned], use_tqdm=False)
        assert (token_ids_of(out[:3]) == ref and out[3]["finish_reason"] == "error"
                and out[3]["token_ids"] == [])
        assert_no_leaks(llm)
    finally:
        llm.exit()


def test_context_is_reset_even_when_the_forward_raises():
    from nanovllm.utils.context import get_context, set_context
    empty = get_context()
    try:
        with set_context(True, max_seqlen_q=3):
            assert get_context().is_prefill and get_context().max_seqlen_q == 3
            raise RuntimeError("forward failed")
    except RuntimeError:
        pass
    assert get_context() is empty


# ---- memory: a cache too large, an engine dropped ------------------------------------------------
def test_a_kv_cache_too_large_to_allocate_is_named(tiny):
    with pytest.raises(ValueError, match=r"cannot allocate a KV cache of 1000000000 blocks "
                                         r".*num_kvcache_blocks"):
        LLM(tiny, kvcache_block_size=16, num_kvcache_blocks=10 ** 9)


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2 ** 20


def test_del_frees_the_engine_and_its_memory(tiny):
    before = _rss_mib()
    # a 256 MiB KV cache
    llm = LLM(tiny, kvcache_block_size=16, max_model_len=512, num_kvcache_blocks=16384,
              device="cpu")
    llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
    engine, cache = weakref.ref(llm), weakref.ref(llm.model_runner.kv_cache)
    assert _rss_mib() - before > 200
    del llm
    gc.collect()
    assert engine() is None and cache() is None
    assert _rss_mib() - before < 100


@pytest.mark.gpu
def test_del_frees_the_device_memory(tiny):
    """Every engine gives back all it took. The first CUDA work of a process leaves torch's own
    state behind (cuBLAS and cuBLASLt workspaces: 64 MiB on an H200), so one engine runs first and
    the second is measured."""
    import torch

    def run_one() -> weakref.ref:
        llm = LLM(tiny, kvcache_block_size=16, max_model_len=512, num_kvcache_blocks=16384,
                  device="cuda")
        llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
        assert torch.cuda.memory_allocated() - before > 200 * 2 ** 20
        return weakref.ref(llm)

    before = 0
    first = run_one()
    gc.collect()
    assert first() is None
    before = torch.cuda.memory_allocated()
    engine = run_one()
    gc.collect()
    assert engine() is None and torch.cuda.memory_allocated() - before < 2 ** 20


@pytest.mark.gpu
def test_an_engine_after_exit_gets_the_whole_card_again(tiny):
    """Sized from the free memory (gpu_memory_utilization): the second engine, built while the first
    object is still referenced, gets the first one's blocks, since exit() returned the first cache
    to the device."""
    first = LLM(tiny, kvcache_block_size=16, max_model_len=512, device="cuda")
    blocks = first.model_runner.num_kvcache_blocks
    first.exit()
    with LLM(tiny, kvcache_block_size=16, max_model_len=512, device="cuda") as second:
        assert abs(second.model_runner.num_kvcache_blocks - blocks) <= blocks // 100
        assert second.generate([[1, 2, 3]], GREEDY, use_tqdm=False)[0]["token_ids"]


# ---- threads -------------------------------------------------------------------------------------
def _in_threads(work, n: int = 2) -> list:
    """work(i) in n threads at once; its results in order (an exception raised in a thread is
    re-raised)."""
    results: list = [None] * n

    def run(i):
        try:
            results[i] = work(i)
        except Exception as e:  # surfaced below
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for r in results:
        if isinstance(r, Exception):
            raise r
    return results


def test_generate_from_two_threads(llm):
    batches = [random_prompts(4, 5, 30, seed=90 + i) for i in range(2)]
    ref = [token_ids_of(llm.generate(b, GREEDY, use_tqdm=False)) for b in batches]
    assert _in_threads(
        lambda i: token_ids_of(llm.generate(batches[i], GREEDY, use_tqdm=False))) == ref
    assert_no_leaks(llm)


def test_engines_in_their_own_threads_are_independent(tiny):
    prompts = random_prompts(4, 5, 30, seed=95)
    ref = token_ids_of(LLM(tiny, **ENGINE).generate(prompts, GREEDY, use_tqdm=False))

    def work(i):
        with LLM(tiny, **ENGINE) as llm:
            return token_ids_of(llm.generate(prompts, GREEDY, use_tqdm=False))

    assert _in_threads(work) == [ref, ref]


# ---- exhaustion: a batch far larger than the cache, a soak ---------------------------------------
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
    big = LLM(tiny, **{**CPU_ENGINE, "num_kvcache_blocks": 4096})
    try:
        ref = big.generate(prompts[::20], sp, use_tqdm=False)
    finally:
        big.exit()
    assert all(len(o["token_ids"]) == 6 for o in out)
    assert [o["token_ids"] for o in out[::20]] == [r["token_ids"] for r in ref]


@pytest.mark.slow
def test_soak_ten_thousand_requests(tiny):
    """10,000 requests (mixed lengths, shared prefixes, cache pressure) in 5 waves through one
    engine: all complete with the right lengths, no blocks leak, and neither Python objects nor the
    prefix map grow."""
    llm = LLM(tiny, kvcache_block_size=16, max_model_len=512, num_kvcache_blocks=64,
              max_num_seqs=128, device="cpu")
    bm = llm.scheduler.block_manager
    shared = random_prompts(4, 40, 40, seed=60)
    objects = []
    try:
        for wave in range(5):
            tails = random_prompts(2000, 1, 30, seed=61 + wave)
            prompts = [shared[i % 4] + t if i % 2 else t for i, t in enumerate(tails)]
            params = [SamplingParams(temperature=0.0 if i % 3 else 0.8, max_tokens=1 + i % 5,
                                     ignore_eos=True)
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


def test_exit_frees_the_kv_cache_and_the_weights_at_once(tiny):
    """exit() hands the device memory back then, not when the engine object goes: a second engine of
    the same process sizes its cache from what is free (on CUDA, one left holding 90% of the card
    got no blocks)."""
    llm = LLM(tiny, **CPU_ENGINE)
    runner = llm.model_runner
    held = [weakref.ref(runner.kv_cache), weakref.ref(next(runner.model.parameters()))]
    assert all(ref() is not None for ref in held)
    llm.exit()
    # no gc.collect(): nothing refers to them any more
    assert [ref() for ref in held] == [None, None]
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate(["again"], SamplingParams(max_tokens=1), use_tqdm=False)


def test_every_call_after_exit_is_the_one_shut_down_error(tiny):
    """After exit() no call queues work or fails with an internal error: each raises the same
    RuntimeError."""
    llm = LLM(tiny, **CPU_ENGINE, enable_sleep_mode=True)
    llm.exit()
    sp = SamplingParams(max_tokens=1)
    calls = {"add_request (nano-vllm's)": lambda: llm.add_request([1, 2], sp),
             "add_request (vLLM's)": lambda: llm.add_request("r", [1, 2], sp),
             "abort_request": lambda: llm.abort_request("r"),
             "has_unfinished_requests": llm.has_unfinished_requests,
             "get_num_unfinished_requests": llm.get_num_unfinished_requests,
             "step": llm.step, "stream": lambda: next(iter(llm.stream([[1, 2]], sp))),
             "sleep": llm.sleep, "wake_up": llm.wake_up,
             "update_weights": lambda: llm.update_weights([]),
             "collective_rpc": lambda: llm.collective_rpc("resolve"),
             "reset_prefix_cache": llm.reset_prefix_cache, "get_metrics": llm.get_metrics,
             "generate": lambda: llm.generate([[1, 2]], sp, use_tqdm=False)}
    wrong = {}
    for name, call in calls.items():
        try:
            call()
            wrong[name] = "no error"
        except Exception as e:
            if not (isinstance(e, RuntimeError) and "the engine has been shut down" in str(e)):
                wrong[name] = repr(e)
    assert wrong == {}
    llm.exit()  # twice is fine


@pytest.mark.parametrize("delay", [0.0, 0.02, 0.1, 0.3])
def test_exit_from_another_thread_during_generate_is_the_shut_down_error(tiny, delay):
    """A watchdog's exit() while generate runs: the step in progress ends first, then generate
    raises the one shut-down error (it raised IndexError, out-of-bounds or NoneType errors from a
    cache freed under a running step), or returns if it finished before."""
    llm = LLM(tiny, **CPU_ENGINE)
    outcome = []

    def run():
        try:
            llm.generate([[1, 2, 3]] * 8, SamplingParams(max_tokens=200, ignore_eos=True),
                         use_tqdm=False)
            outcome.append("finished")
        except Exception as e:
            outcome.append(e)
    thread = threading.Thread(target=run)
    thread.start()
    time.sleep(delay)
    llm.exit()
    thread.join(60)
    assert not thread.is_alive() and len(outcome) == 1
    assert outcome[0] == "finished" or (isinstance(outcome[0], RuntimeError) and
                                        "the engine has been shut down" in str(outcome[0])), \
        repr(outcome[0])


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_request_whose_logits_turn_nan_ends_with_an_error_naming_it(
        tiny, monkeypatch, async_scheduling, temperature):
    """NaN logits at run time (a fault in the weights or their scales): that request ends with
    finish_reason "error" naming the cause, without the failing step's token; the others finish
    with their own tokens, and the engine serves on."""
    llm = LLM(tiny, **ENGINE, async_scheduling=async_scheduling)
    try:
        sp = SamplingParams(temperature=temperature, max_tokens=8, ignore_eos=True, seed=3)
        prompts, poisoned = random_prompts(3, 5, 20, seed=75), [7] * 30
        ref = token_ids_of(llm.generate(prompts + [poisoned], sp, use_tqdm=False))
        runner, original = llm.model_runner, llm.model_runner.forward

        def forward(step, sampling=None):
            logits, prompt_logprobs = original(step, sampling)
            if not step.is_prefill:  # the input at position 33: the poisoned prompt's 5th token
                logits = logits.clone()
                logits[torch.as_tensor(step.positions == 33)] = float("nan")
            return logits, prompt_logprobs

        monkeypatch.setattr(runner, "forward", forward)
        out = llm.generate(prompts + [poisoned], sp, use_tqdm=False)
        assert token_ids_of(out[:3]) == ref[:3]
        assert out[3]["finish_reason"] == "error" and "logits were NaN" in out[3]["error"]
        assert out[3]["token_ids"] == ref[3][:4]  # not the token sampled from NaN logits
        assert_no_leaks(llm)
        monkeypatch.setattr(runner, "forward", original)
        assert token_ids_of(llm.generate(prompts + [poisoned], sp, use_tqdm=False)) == ref
    finally:
        llm.exit()
