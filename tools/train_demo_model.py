"""Trains the demo model: a tiny Qwen3 on the Python standard library's own source (Lib/**/*.py of
the running interpreter without its test suites, which every machine has offline), with a byte-level
BPE tokenizer trained on the same files. A few files are held out for validation and copied beside
the model, since the CPU and GPU machines run different Python versions. Seeded; prints the train
and validation loss curve and keeps the weights of the best validation loss.

    python tools/train_demo_model.py --out nanovllm/demo/model  # on a GPU, about 2 minutes
    python tools/train_demo_model.py --out /tmp/demo --include-tests  # also the test suites
    python tools/train_demo_model.py --out /tmp/demo --steps 20 --batch-size 4  # a smoke run on CPU
    # the demo model's draft (speculative decoding): two layers, the demo model's tokenizer
    python tools/train_demo_model.py --out nanovllm/demo/draft --layers 2 \
        --tokenizer nanovllm/demo/model --steps 1500 --batch-size 32
"""
from __future__ import annotations

import argparse
import math
import os
import random
import shutil
import sysconfig
import time
from pathlib import Path

import torch

# never trained on; evaluation files
HELD_OUT = ("textwrap.py", "colorsys.py", "bisect.py", "heapq.py")
EOS = "<|endoftext|>"


# test suites, third-party code
SKIPPED_DIRS = {"test", "tests", "idle_test", "site-packages", "lib2to3"}


def corpus_files(include_tests: bool = False) -> list[Path]:
    lib = Path(sysconfig.get_paths()["stdlib"])
    skipped = SKIPPED_DIRS - {"test", "tests", "idle_test"} if include_tests else SKIPPED_DIRS
    return sorted(p for p in lib.rglob("*.py")
                  if p.name not in HELD_OUT and p.stat().st_size < 500_000
                  and not skipped & set(p.relative_to(lib).parts))


def train_tokenizer(files: list[Path], vocab_size: int, out: Path):
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast
    bpe = ByteLevelBPETokenizer()
    bpe.train([str(f) for f in files], vocab_size=vocab_size, min_frequency=2, special_tokens=[EOS])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token=EOS)
    tokenizer.save_pretrained(out)
    return tokenizer


def encode_corpus(tokenizer, files: list[Path]) -> torch.Tensor:
    ids: list[int] = []
    for f in files:
        ids.extend(tokenizer.encode(f.read_text(errors="replace")))
        ids.append(tokenizer.eos_token_id)
    return torch.tensor(ids, dtype=torch.long)


def batches(data: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator):
    while True:
        starts = torch.randint(0, len(data) - seq_len - 1, (batch_size,), generator=generator)
        yield torch.stack([data[s:s + seq_len] for s in starts.tolist()])


@torch.no_grad()
def evaluate(model, data: torch.Tensor, seq_len: int, device: str, max_windows: int = 64) -> float:
    model.eval()
    losses = []
    for start in range(0, min(len(data) - seq_len - 1, max_windows * seq_len), seq_len):
        window = data[start:start + seq_len].to(device)[None]
        # the model shifts the labels itself
        losses.append(float(model(window, labels=window).loss))
    model.train()
    return sum(losses) / len(losses)


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="nanovllm/demo/model")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--intermediate-size", type=int, default=640)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--attention-dropout", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer", help="a directory whose tokenizer to use (and copy) instead "
                                            "of training one: a draft model shares its target's")
    parser.add_argument("--include-tests", action="store_true",
                        help="also train on the standard library's test suites "
                             "(about four times the code)")
    args = parser.parse_args()
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True, warn_only=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    files = corpus_files(args.include_tests)
    if args.tokenizer:
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
        tokenizer.save_pretrained(out)
    else:
        tokenizer = train_tokenizer(files, args.vocab_size, out)
    train = encode_corpus(tokenizer, files)
    val = encode_corpus(tokenizer,
                        [Path(sysconfig.get_paths()["stdlib"]) / name for name in HELD_OUT])
    print(f"corpus: {len(files)} files, {len(train):,} tokens (vocab {len(tokenizer)}); "
          f"validation: {', '.join(HELD_OUT)}, {len(val):,} tokens", flush=True)

    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=args.hidden_size,
                         intermediate_size=args.intermediate_size, num_hidden_layers=args.layers,
                         num_attention_heads=args.hidden_size // 64,
                         num_key_value_heads=max(1, args.hidden_size // 128),
                         head_dim=64, max_position_embeddings=1024,
                         attention_dropout=args.attention_dropout,
                         tie_word_embeddings=True, bos_token_id=tokenizer.eos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
    config.architectures = ["Qwen3ForCausalLM"]
    model = Qwen3ForCausalLM(config).to(device)
    print(f"parameters: {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M", flush=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1,
                                  betas=(0.9, 0.95))
    warmup = max(1, args.steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer,
                                                 lambda s: min(1.0, (s + 1) / warmup) * 0.5 *
                                                 (1 + math.cos(math.pi * min(1.0, s / args.steps))))
    stream = batches(train, args.batch_size, args.seq_len, torch.Generator().manual_seed(args.seed))
    start = time.time()
    best = (float("inf"), 0, None)  # (validation loss, step, weights)
    for step in range(1, args.steps + 1):
        batch = next(stream).to(device)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            # transformers shifts the labels: position t predicts t + 1
            loss = model(batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        if step % args.eval_every == 0 or step == args.steps:
            val_loss = evaluate(model, val, args.seq_len, device)
            if val_loss < best[0]:
                best = (val_loss, step,
                        {k: v.detach().clone() for k, v in model.state_dict().items()})
            print(f"step {step:5d}  train loss {loss.item():.3f}  val loss {val_loss:.3f}  "
                  f"({time.time() - start:.0f} s)", flush=True)

    model.load_state_dict(best[2])
    print(f"kept step {best[1]}: validation loss {best[0]:.3f} "
          f"(perplexity {math.exp(best[0]):.2f})", flush=True)
    model.to(torch.bfloat16).save_pretrained(out)
    GenerationConfig(eos_token_id=tokenizer.eos_token_id,
                     bos_token_id=tokenizer.eos_token_id).save_pretrained(out)
    heldout = out / "heldout"
    heldout.mkdir(exist_ok=True)
    for name in HELD_OUT:
        shutil.copy(Path(sysconfig.get_paths()["stdlib"]) / name, heldout / name)
    size = os.path.getsize(out / "model.safetensors") / 2 ** 20
    print(f"saved {out} (model.safetensors {size:.1f} MiB), held-out files in {heldout}")


if __name__ == "__main__":
    main()
