"""Throughput on nano-vllm's benchmark workload, and how close it is to the physical limit.

Workload (nano-vllm's bench.py): seed 0, 256 sequences of random token ids, prompt and output
lengths uniform in [100, 1024], temperature 0.6, ignore_eos (133,966 output tokens). A warmup
request runs first. On CUDA the copy bandwidth and bf16 matmul rate are measured at start and the
result is also printed as a fraction of the workload's roofline (``roofline`` below:
weights read once per decode step, every cached K/V read once per decode step that attends to it,
all matmul and attention FLOPs; memory and compute overlapped perfectly).

    python bench.py                    # Qwen3-0.6B shapes, random weights, on the GPU
    python bench.py --scenario batch1  # one of SCENARIOS (latency, prefill-heavy, shared prefix)
    python bench.py --model /path/to/checkpoint --attention-backend flash-attn --json
    python bench.py --engine hf        # the same workload through transformers
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from random import Random, randint, seed

import torch

from nanovllm import LLM, SamplingParams
from nanovllm.models.presets import PRESETS, preset_config


def workload(num_seqs: int = 256, min_len: int = 100, max_input_len: int = 1024,
             max_output_len: int = 1024):
    """nano-vllm's bench workload: all prompts are drawn first, then all output lengths."""
    seed(0)
    prompts = [[randint(0, 10000) for _ in range(randint(min_len, max_input_len))]
               for _ in range(num_seqs)]
    params = [SamplingParams(temperature=0.6, ignore_eos=True,
                             max_tokens=randint(min_len, max_output_len))
              for _ in range(num_seqs)]
    return prompts, params


@dataclass(frozen=True)
class Scenario:
    """A workload of equal requests: ``num_seqs`` prompts of ``shared_prefix`` common tokens and
    ``prompt_len`` of their own, ``n`` completions of ``output_len`` tokens each (ignore_eos)."""

    num_seqs: int
    prompt_len: int
    output_len: int
    shared_prefix: int = 0
    model: str | None = None  # the preset it runs unless --model names another
    n: int = 1
    temperature: float = 0.6
    speculative_config: dict | None = None  # unless --speculative-config gives one


SCENARIOS = {
    "batch1": Scenario(1, 512, 1024),        # one request: the decode step's latency
    "batch1-8b": Scenario(1, 512, 1024, model="qwen3-8b"),
    "batch16": Scenario(16, 512, 512),
    "long": Scenario(32, 8192, 256),         # prefill-heavy
    # a system prompt shared by every request
    "prefix": Scenario(256, 128, 128, shared_prefix=2048),
    # an RL trainer's rollouts: a group of 8 completions of each prompt (GRPO)
    "rl": Scenario(64, 512, 512, n=8, temperature=1.0),
    # batch1 with n-gram proposals (random tokens and weights: what proposing costs when the
    # proposals are rejected; tools/bench_spec.py measures speed against acceptance)
    "batch1-ngram": Scenario(1, 512, 1024, speculative_config={
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
        "prompt_lookup_max": 4}),
}


def scenario_workload(s: Scenario, seed: int, scale: float = 1.0, vocab: int = 10000):
    """(prompts, params, the shared prefix's length); ``seed`` picks the tokens (the warmup uses
    another seed: same shapes, no prefix-cache hits on the timed run's tokens); ``scale`` shrinks
    every length."""
    rng = Random(seed)
    length = lambda n: max(1, round(n * scale)) if n else 0  # noqa: E731
    prefix = [rng.randrange(vocab) for _ in range(length(s.shared_prefix))]
    prompts = [prefix + [rng.randrange(vocab) for _ in range(length(s.prompt_len))]
               for _ in range(s.num_seqs)]
    params = [SamplingParams(n=s.n, temperature=s.temperature, ignore_eos=True,
                             max_tokens=length(s.output_len)) for _ in prompts]
    return prompts, params, len(prefix)


@dataclass
class Roofline:
    output_tokens: int
    seconds_memory: float
    seconds_compute: float

    @property
    def tok_per_s(self) -> float:
        """Output tokens per second with memory and compute perfectly overlapped."""
        return self.output_tokens / max(self.seconds_memory, self.seconds_compute)


def experts_touched(num_experts: int, top_k: int, batch: int) -> float:
    """The expected number of distinct experts a batch of ``batch`` tokens reads in one sparse
    layer, each token choosing ``top_k`` of ``num_experts`` uniformly: E * (1 - (1 - k/E)^B)."""
    return num_experts * (1 - (1 - top_k / num_experts) ** batch)


def roofline(hf_config, prompt_lens: list[int], output_lens: list[int], bandwidth: float,
             flops: float, dtype_bytes: int = 2, shared_prefix: int = 0,
             kv_dtype_bytes: int | None = None, weight_bytes: float | None = None,
             expert_bytes: float | None = None, linear_flops: float | None = None,
             siblings: int = 1) -> Roofline:
    """The fewest bytes and FLOPs any engine must spend on this workload with this model (a prefix
    that every prompt shares, ``shared_prefix`` tokens, is prefilled once and its K/V read once per
    step; ``siblings``: the sequences come in runs of that many completions of one prompt, each
    prompt prefilled once and its K/V read once per step for its run; K/V of ``kv_dtype_bytes`` a
    value, the weights' by default, 1 for an fp8 cache). A mixture
    of experts' sparse layer reads, per decode step, the experts its batch touches
    (``experts_touched`` at the step's number of running sequences) and computes top-k experts per
    token. Quantized weights: ``weight_bytes`` per element of the layers' projections (fp8: 1 and
    its share of the scales), ``expert_bytes`` of the experts' (default: ``dtype_bytes``; the
    embeddings, the LM head and the routers stay there), multiplied at ``linear_flops`` FLOP/s
    (default ``flops``)."""
    from nanovllm.features.moe import is_sparse_layer
    if siblings > 1 and (shared_prefix or len(prompt_lens) % siblings):
        raise ValueError(f"siblings={siblings} needs whole runs and no shared_prefix")
    c = hf_config
    h, layers, vocab = c.hidden_size, c.num_hidden_layers, c.vocab_size
    heads, kv_heads = c.num_attention_heads, c.num_key_value_heads
    head_dim = getattr(c, "head_dim", None) or h // heads
    num_experts, top_k = getattr(c, "num_experts", 0), getattr(c, "num_experts_per_tok", 0)
    sparse = sum(is_sparse_layer(c, i) for i in range(layers)) if num_experts else 0
    expert = 3 * h * c.moe_intermediate_size if sparse else 0
    attn = h * (heads + 2 * kv_heads) * head_dim + heads * head_dim * h
    # what every step reads (the routers too) and what a token multiplies by
    # (top-k experts of each sparse layer)
    weight_bytes = dtype_bytes if weight_bytes is None else weight_bytes
    expert_bytes = dtype_bytes if expert_bytes is None else expert_bytes
    projections = layers * attn + (layers - sparse) * 3 * h * c.intermediate_size
    other = sparse * num_experts * h + vocab * h * (1 if c.tie_word_embeddings else 2)
    params_layer = (projections + sparse * (num_experts * h + top_k * expert)) / layers
    kv_per_token = 2 * layers * kv_heads * head_dim * (dtype_bytes if kv_dtype_bytes is None
                                                       else kv_dtype_bytes)
    firsts = prompt_lens[::siblings]  # the prompts prefilled (each run's once)
    prefill_tokens, total_out = (sum(firsts) - (len(firsts) - 1) * shared_prefix,
                                 sum(output_lens))
    # decode step t (1 .. out-1) of a sequence attends over prompt + t tokens;
    # the first token comes from prefill
    kv_reads = sum(i * (o - 1) + o * (o - 1) // 2 for i, o in zip(prompt_lens, output_lens))
    decode_steps = max(output_lens) - 1
    flops_linear = 2 * layers * params_layer * (prefill_tokens + total_out)
    flops_head = 2 * vocab * h * (len(prompt_lens) + total_out)  # last prompt token + each output
    prefill_pairs = shared_prefix ** 2 / 2 + sum((i - shared_prefix) * (i + shared_prefix) / 2
                                                 for i in firsts)
    flops_attn = 4 * layers * heads * head_dim * (prefill_pairs + kv_reads)
    # a shared prefix's K/V need be read only once per decode step for the whole batch
    # (its blocks are shared)
    kv_bytes_read = (kv_reads - sum(shared_prefix * (o - 1) for o in output_lens)
                     + shared_prefix * decode_steps)
    # and a run of siblings' prompt once per step for the run
    kv_bytes_read -= sum(i * (o - 1) for i, o in zip(prompt_lens, output_lens)) - sum(
        prompt_lens[r] * (max(output_lens[r:r + siblings]) - 1)
        for r in range(0, len(prompt_lens), siblings))
    # decode step t (1 .. max out - 1) runs the sequences with more than t outputs;
    # its experts' weights
    running = [sum(o - 1 >= t for o in output_lens)
               for t in range(1, decode_steps + 1)] if sparse else []
    expert_reads = sparse * expert * sum(experts_touched(num_experts, top_k, b) for b in running)
    bytes_moved = (decode_steps * (projections * weight_bytes + other * dtype_bytes)
                   + expert_reads * expert_bytes + (kv_bytes_read + prefill_tokens) * kv_per_token)
    seconds_compute = flops_linear / (linear_flops or flops) + (flops_head + flops_attn) / flops
    return Roofline(total_out, bytes_moved / bandwidth, seconds_compute)


def _median_seconds(fn, reps: int = 20) -> float:
    fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def _copy_rate() -> float:
    x = torch.empty(2 ** 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    return 2 * x.numel() / _median_seconds(lambda: y.copy_(x))


def _matmul_rate(n: int = 8192) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    return 2 * n ** 3 / _median_seconds(lambda: a @ b)


def fp8_matmul_rate(n: int = 8192) -> float:
    """e4m3 x e4m3 matmul FLOP/s (cuBLASLt through ``torch._scaled_mm``, bf16 out), random data."""
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).t()  # column-major (cuBLASLt's)
    one = torch.ones((), device="cuda")
    return 2 * n ** 3 / _median_seconds(lambda: torch._scaled_mm(a, b, one, one,
                                                                 out_dtype=torch.bfloat16))


def measure_ceilings() -> tuple[float, float]:
    """(device copy bytes/s counting read + write, bf16 matmul FLOP/s on random data), medians."""
    ceilings = _copy_rate(), _matmul_rate()
    torch.cuda.empty_cache()
    return ceilings


def model_config(model: str):
    if model in PRESETS:
        return preset_config(model)
    from transformers import AutoConfig
    return AutoConfig.from_pretrained(model)


def run_nanovllm(args, prompts, params) -> float:
    dummy = args.model in PRESETS
    longest = max(len(p) + sp.max_tokens for p, sp in zip(prompts, params))
    llm = LLM(args.model, tensor_parallel_size=args.tp, enforce_eager=args.enforce_eager,
              max_model_len=max(args.max_model_len, longest),
              attention_backend=args.attention_backend,
              load_format="dummy" if dummy else "auto", skip_tokenizer_init=dummy,
              async_scheduling=False if args.no_async_scheduling else None,
              kv_cache_dtype=args.kv_cache_dtype,
              quantization=args.quantization, disable_cascade_attn=args.disable_cascade_attn,
              speculative_config=args.speculative_config,
              **({} if args.block_size is None else dict(kvcache_block_size=args.block_size)))
    args.block_size = llm.config.kvcache_block_size
    args.async_scheduling = llm.config.async_scheduling
    args.cascade_attn = not llm.config.disable_cascade_attn
    args.attention_backend = llm.model_runner.attention_backend.name
    args.kv_cache_tokens = llm.config.num_kvcache_blocks * args.block_size  # what the cache holds
    fp8 = llm.features.get("fp8")
    quant = fp8.quant_config if fp8 is not None else None
    args.weights = ("bf16" if quant is None else "fp8 block-wise" if quant.weight_block_size
                    else "fp8 per-channel")
    if quant is not None:  # bytes per projection weight: e4m3 and its share of the float32 scales
        bn, bk = quant.weight_block_size or (1, llm.config.hf_config.hidden_size)  # ~K per scale
        args.weight_bytes = 1 + 4 / (bn * bk)
        args.expert_bytes = args.weight_bytes if quant.weight_block_size else None
    if args.scenario == "default":
        llm.generate(warmup_prompts(prompts, llm.config.hf_config.vocab_size),
                     SamplingParams(max_tokens=2), use_tqdm=False)
    else:  # the same shapes, other tokens
        llm.generate(*scenario_workload(SCENARIOS[args.scenario], 1, args.scale)[:2],
                     use_tqdm=False)
    core = llm.core if "speculative" in llm.features else None  # the verify core's counters
    before = core and (core.num_draft_tokens, core.num_accepted_tokens)
    with gpu_busy_time(args) as busy:
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
    if core:  # of the timed run: proposed tokens, the share accepted
        args.spec_draft_tokens = proposed = core.num_draft_tokens - before[0]
        accepted = core.num_accepted_tokens - before[1]
        args.spec_acceptance = round(accepted / max(1, proposed), 3)
    if busy:
        args.gpu_busy_fraction = round(busy[0] / elapsed, 3)
    llm.exit()
    return elapsed


def warmup_prompts(prompts: list[list[int]], vocab_size: int) -> list[list[int]]:
    """The workload's prompt lengths with other random tokens: the warmup compiles what the timed
    run needs (Triton kernel variants, torch.compile's shapes of full prefill batches and chunks)
    without leaving blocks the timed run could find in the prefix cache."""
    rng = Random(1)
    return [[rng.randrange(vocab_size) for _ in p] for p in prompts]


@contextmanager
def gpu_busy_time(args):
    """With --profile: the summed time of every GPU kernel of the run (torch.profiler), so that
    busy / wall says how long the GPU waited for the CPU between kernels and steps."""
    busy: list[float] = []
    if not args.profile:
        yield busy
        return
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        yield busy
    events = prof.key_averages()
    try:  # where the GPU time goes, kernel by kernel (stderr)
        print(events.table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=90),
              file=sys.stderr)
    except Exception as e:  # a profiler API change must not cost the measurement
        print(f"no kernel table: {e}", file=sys.stderr)
    busy.append(sum(getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)
                    for e in events) / 1e6)


def run_hf(args, prompts, params) -> float:
    """The same workload through transformers' continuous batching, bf16, on the same GPU."""
    from transformers import AutoModelForCausalLM, GenerationConfig
    if any(sp.n > 1 or sp.temperature != 0.6 for sp in params):
        raise ValueError(f"--engine hf runs one completion a request at temperature 0.6; "
                         f"--scenario {args.scenario} asks for n={params[0].n}, "
                         f"temperature={params[0].temperature}")
    if args.model in PRESETS:
        with torch.device("cuda"):
            model = AutoModelForCausalLM.from_config(preset_config(args.model),
                                                     dtype=torch.bfloat16)
    else:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16).cuda()
    model.eval()
    # eos_token_id=None: transformers disables EOS (ignore_eos);
    # do_sample at temperature 0.6, as ours
    generation_config = GenerationConfig(do_sample=True, temperature=0.6, top_k=0, top_p=1.0,
                                         eos_token_id=None, pad_token_id=0,
                                         max_new_tokens=max(sp.max_tokens for sp in params))
    manager = model.init_continuous_batching(generation_config=generation_config)
    manager.start()
    # warmup, through the same manager
    manager.add_request([1] * 16, request_id="warmup", max_new_tokens=16)
    while (result := manager.get_result(timeout=1)) is None or not result.is_finished():
        pass
    start = time.perf_counter()
    for i, (prompt, sp) in enumerate(zip(prompts, params)):
        manager.add_request(prompt, request_id=str(i), max_new_tokens=sp.max_tokens)
    finished, generated = 0, 0
    while finished < len(prompts):
        result = manager.get_result(timeout=1)
        if result is not None and getattr(result, "error", None):
            manager.stop()
            raise RuntimeError(f"transformers failed request {result.request_id}: {result.error}")
        if result is not None and result.is_finished():
            finished += 1
            generated += len(result.generated_tokens)
    elapsed = time.perf_counter() - start
    manager.stop()
    expected = sum(sp.max_tokens for sp in params)
    if generated != expected:
        print(f"warning: transformers generated {generated} tokens, "
              f"the workload asks for {expected}")
    return elapsed


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model",
                        help="a checkpoint directory, or a preset with random weights: "
                             f"{sorted(PRESETS)} (default: the scenario's, else qwen3-0.6b)")
    parser.add_argument("--engine", choices=["nanovllm", "hf"], default="nanovllm")
    parser.add_argument("--scenario", choices=["default", *SCENARIOS], default="default",
                        help="default: nano-vllm's workload (the --num-seqs/--*-len flags); "
                             "else one of SCENARIOS")
    parser.add_argument("--scale", type=float, default=1.0,
                        help="a scenario's lengths times this (CPU tests)")
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--min-len", type=int, default=100)
    parser.add_argument("--max-input-len", type=int, default=1024)
    parser.add_argument("--max-output-len", type=int, default=1024)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--disable-cascade-attn", action="store_true",
                        help="each sequence reads its shared prefix (no cascade decode attention)")
    parser.add_argument("--no-async-scheduling", action="store_true",
                        help="read each step's tokens before scheduling the next "
                             "(async scheduling is on by default on CUDA)")
    parser.add_argument("--attention-backend", default="auto",
                        choices=["auto", "triton", "flash-attn", "torch"])
    parser.add_argument("--block-size", type=int, help="kvcache_block_size (default: the engine's)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3"])
    parser.add_argument("--quantization", choices=["fp8"],
                        help="fp8: quantize the weights at load (per channel); "
                             "a *-fp8 preset is block-wise fp8")
    parser.add_argument("--speculative-config", type=json.loads, default=None,
                        help="vLLM's speculative_config as JSON, e.g. "
                             "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4}'")
    parser.add_argument("--json", action="store_true", help="print one JSON result line")
    parser.add_argument("--profile", action="store_true",
                        help="measure the GPU's busy share of the run with torch.profiler "
                             "(slows the run a little)")
    args = parser.parse_args()
    args.model = (args.model or (args.scenario != "default" and SCENARIOS[args.scenario].model)
                  or "qwen3-0.6b")
    if args.scenario == "default":
        prompts, params = workload(args.num_seqs, args.min_len, args.max_input_len,
                                   args.max_output_len)
        shared_prefix = 0
    else:
        prompts, params, shared_prefix = scenario_workload(SCENARIOS[args.scenario], 0, args.scale)
        args.speculative_config = (args.speculative_config
                                   or SCENARIOS[args.scenario].speculative_config)
    ceilings = measure_ceilings() if torch.cuda.is_available() else None
    seconds = (run_hf if args.engine == "hf" else run_nanovllm)(args, prompts, params)
    total = sum(sp.max_tokens * sp.n for sp in params)
    result = dict(engine=args.engine, model=args.model, scenario=args.scenario,
                  attention_backend=args.attention_backend, tp=args.tp, block_size=args.block_size,
                  kv_cache_dtype=args.kv_cache_dtype,
                  kv_cache_tokens=getattr(args, "kv_cache_tokens", None),
                  weights=getattr(args, "weights", None), cuda_graphs=not args.enforce_eager,
                 
                  async_scheduling=getattr(args, "async_scheduling", None),
                  cascade_attn=getattr(args, "cascade_attn", None),
                  speculative_config=args.speculative_config,
                  **{k: getattr(args, k) for k in ("spec_draft_tokens", "spec_acceptance")
                     if hasattr(args, k)},
                  num_seqs=len(prompts), output_tokens=total,
                  seconds=round(seconds, 3), tok_per_s=round(total / seconds, 1),
                  device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                  date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    if getattr(args, "gpu_busy_fraction", None) is not None:
        result["gpu_busy_fraction"] = args.gpu_busy_fraction
    if ceilings:
        weight_bytes = getattr(args, "weight_bytes", None)
        linear_flops = fp8_matmul_rate() if weight_bytes is not None else None  # W8A8
        n = params[0].n  # a scenario's requests are equal
        limit = roofline(model_config(args.model), [len(p) for p in prompts for _ in range(n)],
                         [sp.max_tokens for sp in params for _ in range(n)], *ceilings,
                         shared_prefix=shared_prefix, siblings=n,
                         kv_dtype_bytes=1 if args.kv_cache_dtype.startswith("fp8") else None,
                         weight_bytes=weight_bytes,
                         expert_bytes=getattr(args, "expert_bytes", None),
                         linear_flops=linear_flops)
        result.update(copy_tb_s=round(ceilings[0] / 1e12, 3),
                      matmul_tflop_s=round(ceilings[1] / 1e12, 1),
                      **({} if linear_flops is None else
                         dict(fp8_matmul_tflop_s=round(linear_flops / 1e12, 1))),
                      roofline_tok_per_s=round(limit.tok_per_s),
                      fraction_of_roofline=round(total / seconds / limit.tok_per_s, 3),
                      roofline=asdict(limit))
    if args.json:
        print(json.dumps(result))
        return
    print(f"Total: {total}tok, Time: {seconds:.2f}s, Throughput: {total / seconds:.2f}tok/s")
    if ceilings:
        print(f"Roofline on this GPU (copy {result['copy_tb_s']} TB/s, "
              f"matmul {result['matmul_tflop_s']} TFLOP/s): {result['roofline_tok_per_s']} tok/s; "
              f"this run reached {result['fraction_of_roofline']:.1%} of it")


if __name__ == "__main__":
    main()
