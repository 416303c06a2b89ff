"""What an fp8 KV cache costs in quality: on the shipped demo model, the prompt perplexity of its
held-out code (each file's first --tokens tokens, prefilled in chunks of --chunk so that every chunk
after the first reads its prefix from the cache) and the share of greedy tokens that change on
example.py's snippets, with the cache in the model's dtype ("auto") and in fp8. With ``--preset`` (a
benchmark preset, random weights): the KL divergence of the fp8 cache's next-token distributions
from the model-dtype cache's, over every position of random prompts (prefilled in chunks, so that
later chunks read the cache), and the share of positions whose argmax changes. With ``--weights``:
the demo model's perplexity and greedy changes with its bf16 weights, with the block-wise fp8
checkpoint that tools/quantize_fp8.py writes, and with ``quantization="fp8"`` (quantized at load).

    python tools/kv_quality.py [--kv-cache-dtype fp8] [--device cpu] [--tokens 400] [--chunk 64]
    python tools/kv_quality.py --weights [--block 128] [--device cpu]
    python tools/kv_quality.py --preset qwen3-0.6b [--device cuda] [--prompts 8] [--tokens 1024]
        [--chunk 256]
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools"))

import nanovllm  # noqa: E402
from nanovllm import LLM, SamplingParams  # noqa: E402

SNIPPETS = ["def fibonacci(n):", "class Stack:", "def is_prime(n):",
            "import os\n\ndef list_files(path):"]


def measure(kv_cache_dtype: str, args, model: str = "nanovllm:demo",
            **kwargs) -> tuple[float, list[list[int]]]:
    llm = LLM(model, kv_cache_dtype=kv_cache_dtype, kvcache_block_size=16, device=args.device,
              max_num_batched_tokens=args.chunk, max_model_len=args.tokens + 128, **kwargs)
    try:
        tokenizer = llm.get_tokenizer()
        files = sorted(glob.glob(os.path.join(os.path.dirname(nanovllm.__file__), "demo", "model",
                                              "heldout", "*.py")))
        prompts = [{"prompt_token_ids": tokenizer.encode(open(f).read())[:args.tokens]}
                   for f in files]
        outs = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=0),
                            use_tqdm=False)
        nll = [-e[t] for o in outs for e, t in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:])]
        greedy = llm.generate(SNIPPETS, SamplingParams(temperature=0, max_tokens=64,
                                                       ignore_eos=True), use_tqdm=False)
        return math.exp(sum(nll) / len(nll)), [o.outputs[0].token_ids for o in greedy]
    finally:
        llm.exit()


def preset_kl(kv_cache_dtype: str, args) -> dict:
    """Every position's log-softmax with each cache (the LM head's output, captured), compared."""
    import torch

    from nanovllm.models.presets import preset_config
    vocab = preset_config(args.preset).vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(vocab, (args.tokens,), generator=g).tolist()}
               for _ in range(args.prompts)]
    logprobs = {}
    for kv in ("auto", kv_cache_dtype):
        llm = LLM(args.preset, load_format="dummy", skip_tokenizer_init=True, kv_cache_dtype=kv,
                  device=args.device, max_num_batched_tokens=args.chunk,
                  max_model_len=args.tokens + 16, enforce_eager=True)
        rows = []
        hook = llm.model_runner.model.lm_head.register_forward_hook(
            lambda module, inputs, out, rows=rows: rows.append(out.float().log_softmax(-1).cpu()))
        try:
            llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
        finally:
            hook.remove()
            llm.exit()
        logprobs[kv] = torch.cat(rows)
    ref, got = logprobs["auto"], logprobs[kv_cache_dtype]
    kl = (ref.exp() * (ref - got)).sum(-1)
    return dict(preset=args.preset, kv_cache_dtype=kv_cache_dtype, device=args.device,
                positions=len(kl), kl_mean=float(kl.mean()), kl_max=float(kl.max()),
                argmax_changed=float((ref.argmax(-1) != got.argmax(-1)).float().mean()),
                date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))


def changes(tokens: list[list[int]], other: list[list[int]]) -> dict:
    """Greedy continuations diverge after their first changed token: positions up to it, and the
    first."""
    first_change = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None)
                    for x, y in zip(tokens, other)]
    changed = sum(a != b for x, y in zip(tokens, other) for a, b in zip(x, y))
    return dict(greedy_tokens_changed=changed, greedy_tokens=sum(map(len, tokens)),
                first_changed_position=first_change)


def weights_quality(args) -> dict:
    """The demo model's perplexity with bf16 weights, the block-wise fp8 checkpoint and online
    fp8."""
    import tempfile

    from quantize_fp8 import quantize_checkpoint
    ppl, tokens = measure("auto", args)
    report = dict(device=args.device, block=args.block, perplexity_bf16_weights=round(ppl, 4))
    with tempfile.TemporaryDirectory() as tmp:
        runs = {"fp8_block": measure("auto", args,
                                     quantize_checkpoint("nanovllm:demo", tmp, args.block)),
                "fp8_online": measure("auto", args, quantization="fp8")}
    for name, (ppl_q, tokens_q) in runs.items():
        report[f"perplexity_{name}"] = round(ppl_q, 4)
        report[f"perplexity_ratio_{name}"] = round(ppl_q / ppl, 5)
        report[f"changes_{name}"] = changes(tokens, tokens_q)
    return dict(report, date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kv-cache-dtype", default="fp8")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tokens", type=int, default=400)
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--preset", help="a benchmark preset (random weights): "
                                         "the KL divergence on random prompts")
    parser.add_argument("--prompts", type=int, default=8, help="--preset: how many random prompts")
    parser.add_argument("--weights", action="store_true",
                        help="fp8 weights instead of the fp8 cache")
    parser.add_argument("--block", type=int, default=128,
                        help="--weights: the fp8 checkpoint's block size")
    args = parser.parse_args()
    if args.weights:
        print(json.dumps(weights_quality(args)))
        return
    if args.preset:
        print(json.dumps(preset_kl(args.kv_cache_dtype, args)))
        return
    ppl, tokens = measure("auto", args)
    ppl_kv, tokens_kv = measure(args.kv_cache_dtype, args)
    print(json.dumps(dict(kv_cache_dtype=args.kv_cache_dtype, device=args.device,
                          perplexity_auto=round(ppl, 4), perplexity=round(ppl_kv, 4),
                          perplexity_ratio=round(ppl_kv / ppl, 5), **changes(tokens, tokens_kv),
                          date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))))


if __name__ == "__main__":
    main()
