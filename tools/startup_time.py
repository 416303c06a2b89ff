"""Where the seconds of ``LLM(...)`` go: each phase of construction timed in a fresh process, first
with empty compiler caches (cold: Triton and Inductor compile everything), then again with the
caches the first process left (warm: what a second run on the same machine pays).

Phases: importing torch and nanovllm, resolving the model's directory, reading its config, loading
the tokenizer and finding the EOS ids, building the model, loading weights, binding the attention
backend, the warmup forward, the KV cache, capturing the decode CUDA graphs, and the rest of the
engine. Each is wall time with the device synchronized at its end; what ``LLM(...)`` imports on
first use counts in the phase that imports it.

A preset runs on random weights (``load_format="dummy"``, no tokenizer). ``--checkpoint-of PRESET``
first writes a checkpoint of the preset's architecture as ``save_pretrained`` would (random bf16
weights under Hugging Face's names, shards of at most ``--max-shard-gb``, an index when there are
several), a byte-level BPE tokenizer of the preset's size (``bos_token_id`` tokens, then up to 256
special ones), config.json and generation_config.json, then times the construction from it
(``load_format="auto"``): in a temporary directory, or in ``--checkpoint-dir``, where a later call
finds it again.

    python tools/startup_time.py [--model qwen3-0.6b] [--runs cold warm]
    python tools/startup_time.py --checkpoint-of qwen3-0.6b [--checkpoint-dir DIR]
        [--max-shard-gb 4]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARKER = "startup_time_checkpoint.json"  # written last: what the directory holds, once complete
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # then <|reserved_N|>
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
                 "{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# the tokenizer_class of the real checkpoints' tokenizer_config.json, by model_type
TOKENIZER_CLASS = {"qwen2": "Qwen2Tokenizer", "qwen3": "Qwen2Tokenizer",
                   "qwen3_moe": "Qwen2Tokenizer", "llama": "PreTrainedTokenizerFast"}
# Qwen2's pre-tokenizer split
SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
         r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


# phases of LLM(...) outside ModelRunner._load_and_prepare, and inside it:
# {label: (module, attribute paths)}
OUTER = {"resolve_paths": ("nanovllm.entrypoints.llm", "_resolve_paths"),
         "hf_config": ("nanovllm.entrypoints.llm", "load_hf_config"),
         "tokenizer": ("nanovllm.engine.llm_engine", "load_tokenizer"),
         "eos_token_ids": ("nanovllm.engine.llm_engine", "eos_token_ids")}
INNER = {"load_weights": ("nanovllm.engine.model_runner", "load_dummy_weights", "load_model"),
         "bind_attention_backend": ("nanovllm.engine.model_runner", "bind_backend"),
         "warmup_forward": ("nanovllm.engine.model_runner", "warmup_model"),
         "kv_cache": ("nanovllm.engine.model_runner", "ModelRunner.allocate_kv_cache"),
         "cuda_graph_capture": ("nanovllm.engine.model_runner", "DecodeGraphs")}
RUNNER = {"model_runner_total": ("nanovllm.engine.model_runner", "ModelRunner._load_and_prepare")}


def time_phases(phases: dict[str, float]):
    """Wraps each function of OUTER, INNER and RUNNER to add its wall time (the device synchronized)
    to ``phases[label]``."""
    import importlib

    import torch

    def timed(owner, name: str, label: str):
        fn = getattr(owner, name)

        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                phases[label] = phases.get(label, 0.0) + time.perf_counter() - start

        setattr(owner, name, wrapper)

    for label, (module, *paths) in {**OUTER, **INNER, **RUNNER}.items():
        for path in paths:
            *classes, name = path.split(".")
            owner = importlib.import_module(module)
            for cls in classes:
                owner = getattr(owner, cls)
            timed(owner, name, label)


def child(model: str, dummy: bool) -> dict:
    """Runs in the timed process: wraps the construction phases from outside, builds the LLM once
    (``dummy``: random weights, no tokenizer)."""
    phases: dict[str, float] = {}
    t0 = time.perf_counter()
    import torch  # noqa: F401
    phases["import_torch"] = time.perf_counter() - t0
    t = time.perf_counter()
    sys.path.insert(0, ROOT)
    import nanovllm
    phases["import_nanovllm"] = time.perf_counter() - t
    time_phases(phases)
    t = time.perf_counter()
    llm = nanovllm.LLM(model, load_format="dummy" if dummy else "auto", skip_tokenizer_init=dummy)
    phases["llm_construction"] = time.perf_counter() - t
    llm.exit()
    runner = phases.pop("model_runner_total")
    phases["model_build_and_rest_of_runner"] = runner - sum(phases.get(k, 0) for k in INNER)
    phases["engine_rest"] = (phases["llm_construction"] - runner
                             - sum(phases.get(k, 0) for k in OUTER))
    return {k: round(v, 3) for k, v in phases.items()}


def hf_tensors(config) -> dict:
    """{name: meta tensor} of what ``save_pretrained`` writes for ``config``: the transformers
    model's state dict without tied copies, in the checkpoint's own names (per-expert tensors where
    the model fuses them)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.modeling_utils import (
        remove_tied_weights_from_state_dict,
        revert_weight_conversion,
    )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return revert_weight_conversion(
        model, remove_tied_weights_from_state_dict(model.state_dict(), model))


def shard_plan(tensors: dict, max_bytes: int) -> list[list[str]]:
    """The names of each shard, in order, as huggingface_hub splits them: a new shard where the next
    bf16 tensor would pass ``max_bytes`` (a larger tensor alone)."""
    shards, size = [[]], 0
    for name, tensor in tensors.items():
        nbytes = 2 * math.prod(tensor.shape)
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def random_bf16(name: str, shape, generator):
    """A norm's weight of ones (as trained ones start), else N(0, 0.02)."""
    import torch
    tensor = torch.empty(shape, dtype=torch.bfloat16)
    return (tensor.fill_(1.0) if name.endswith("norm.weight")
            else tensor.normal_(0, 0.02, generator=generator))


def write_weights(path: str, config, max_bytes: int):
    """Random bf16 weights in safetensors shards, one in memory at a time;
    ``model.safetensors.index.json`` when there are several."""
    import torch
    from safetensors.torch import save_file
    tensors, generator = hf_tensors(config), torch.Generator().manual_seed(0)
    shards, weight_map, total = shard_plan(tensors, max_bytes), {}, 0
    for i, names in enumerate(shards, 1):
        file = ("model.safetensors" if len(shards) == 1
                else f"model-{i:05d}-of-{len(shards):05d}.safetensors")
        shard = {name: random_bf16(name, tensors[name].shape, generator) for name in names}
        save_file(shard, os.path.join(path, file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, file))
        total += sum(t.nbytes for t in shard.values())
    if len(shards) > 1:
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


def bpe_vocab(size: int, seed: int = 0) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A byte-level BPE of ``size`` tokens: the 256 byte characters, then merges of random (mostly
    short) tokens into new ones of at most 16 characters."""
    from tokenizers import pre_tokenizers
    tokens = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab, merges, rng = {c: i for i, c in enumerate(tokens)}, [], random.Random(seed)
    while len(vocab) < size:
        a, b = (tokens[int(len(tokens) * rng.random() ** 2)] for _ in range(2))
        if len(a) + len(b) <= 16 and a + b not in vocab:
            vocab[a + b] = len(vocab)
            tokens.append(a + b)
            merges.append((a, b))
    return vocab, merges


def write_tokenizer(path: str, config):
    """A Qwen2-style tokenizer (NFC, its split, byte-level BPE) of ``config.bos_token_id`` regular
    tokens, then the special ones up to 256 or the vocabulary's end; EOS is config.json's first
    ``eos_token_id``."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    first, eos = config.bos_token_id, config.eos_token_id
    eos = eos[0] if isinstance(eos, (list, tuple)) else eos
    vocab, merges = bpe_vocab(first)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(SPLIT), "isolated"),
         pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    count = min(256, config.vocab_size - first)
    specials = (SPECIAL_TOKENS + [f"<|reserved_{i}|>" for i in range(count)])[:count]
    tok.add_special_tokens(specials)  # ids from ``first`` on, in order
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=specials[eos - first],
                                   pad_token=specials[0])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    with open(os.path.join(path, "tokenizer_config.json")) as f:
        tokenizer_config = json.load(f)
    # the class the real checkpoints name
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(dict(tokenizer_config,
                       tokenizer_class=TOKENIZER_CLASS.get(config.model_type, "TokenizersBackend")),
                  f, indent=2)


def write_checkpoint(preset: str, path: str, max_shard_gb: float) -> float | None:
    """Writes ``preset``'s checkpoint into ``path`` unless it already holds it; the seconds it took,
    else None. A ValueError for a directory holding other files."""
    sys.path.insert(0, ROOT)
    from transformers import GenerationConfig

    from nanovllm.models.presets import PRESETS, preset_config
    if preset not in PRESETS:
        raise ValueError(f"--checkpoint-of must be one of {sorted(PRESETS)}, got {preset!r}")
    what = {"preset": preset, "max_shard_gb": max_shard_gb}
    with contextlib.suppress(OSError, ValueError), open(os.path.join(path, MARKER)) as f:
        if json.load(f) == what:
            return None
    if os.path.isdir(path) and os.listdir(path):
        raise ValueError(f"--checkpoint-dir {path!r} holds files but no checkpoint of {what}: "
                         "pass a new or empty directory")
    start = time.perf_counter()
    os.makedirs(path, exist_ok=True)
    config = preset_config(preset)
    write_tokenizer(path, config)
    write_weights(path, config, int(max_shard_gb * 10 ** 9))
    # Qwen3's sampling defaults
    GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                     do_sample=True, temperature=0.6, top_k=20, top_p=0.95).save_pretrained(path)
    config.save_pretrained(path)
    with open(os.path.join(path, MARKER), "w") as f:
        json.dump(what, f)
    os.sync()  # the timed runs would otherwise share the disk and memory with its write-back
    return time.perf_counter() - start


def run_children(model: str, runs: list[str], dummy: bool, **fields):
    """Each run in a fresh process; "warm" after "cold" reuses the compiler caches the cold process
    filled. Prints a line per run: its phases, ``fields``."""
    with tempfile.TemporaryDirectory() as caches:
        env = dict(os.environ, TRITON_CACHE_DIR=os.path.join(caches, "triton"),
                   TORCHINDUCTOR_CACHE_DIR=os.path.join(caches, "inductor"))
        for run in runs:
            start = time.perf_counter()
            out = subprocess.run([sys.executable, __file__, "--child", "--model", model,
                                  *["--dummy"] * dummy],
                                 env=env, capture_output=True, text=True, check=False)
            wall = time.perf_counter() - start
            if out.returncode != 0:
                print(json.dumps(dict(run=run, error=out.stderr[-2000:])), flush=True)
                continue
            phases = json.loads(out.stdout.strip().splitlines()[-1])
            print(json.dumps(dict(run=run, model=model, **fields, process_wall_s=round(wall, 3),
                                  date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                  **phases)), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--runs", nargs="+", default=["cold", "warm"], choices=["cold", "warm"])
    parser.add_argument("--checkpoint-of", metavar="PRESET",
                        help="time a written checkpoint of this preset")
    parser.add_argument("--checkpoint-dir", help="where --checkpoint-of writes (and finds) it; "
                                                 "default: a temporary directory")
    parser.add_argument("--max-shard-gb", type=float, default=4.0,
                        help="largest shard (10^9 bytes; Qwen's)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dummy", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.model, args.dummy)))
        return
    if args.checkpoint_of is None:
        sys.path.insert(0, ROOT)
        from nanovllm.models.presets import PRESETS
        return run_children(args.model, args.runs, args.model in PRESETS)
    with contextlib.ExitStack() as stack:
        path = args.checkpoint_dir or stack.enter_context(
            tempfile.TemporaryDirectory(prefix="startup-ckpt-"))
        seconds = write_checkpoint(args.checkpoint_of, path, args.max_shard_gb)
        print(json.dumps(dict(checkpoint=path, preset=args.checkpoint_of,
                              write_s=seconds and round(seconds, 3),
                              files=sorted(os.listdir(path)))), flush=True)
        run_children(path, args.runs, False, checkpoint_of=args.checkpoint_of)


if __name__ == "__main__":
    main()
