"""Builds a tiny random Qwen3 checkpoint with a byte-level tokenizer, entirely offline.

Used by ``example.py`` when no model is given and by the tests (with transformers as the oracle).
"""
from __future__ import annotations

import json
import os

import torch

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def build_byte_tokenizer(path: str):
    """256 byte tokens (ids 0-255) plus SPECIAL_TOKENS (256, 257, 258); eos is <|endoftext|>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_to_char = {b: c for b, c in zip(range(256), _bytes_to_unicode())}
    assert set(byte_to_char.values()) == set(alphabet)
    vocab = {byte_to_char[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=SPECIAL_TOKENS[0],
                                   additional_special_tokens=SPECIAL_TOKENS[1:])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    return fast


def _bytes_to_unicode() -> list[str]:
    """GPT-2's printable stand-in character for each byte, in byte order."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]


def build_tiny_qwen3(path: str, *, seed: int = 0, vocab_size: int = 320, hidden_size: int = 64,
                     intermediate_size: int = 128, num_hidden_layers: int = 2, num_attention_heads: int = 4,
                     num_key_value_heads: int = 2, head_dim: int = 32, tie_word_embeddings: bool = False,
                     rope_theta: float = 10000.0, max_position_embeddings: int = 1024,
                     initializer_range: float = 0.2, max_shard_size: str | None = None,
                     dtype: torch.dtype = torch.float32) -> str:
    """Saves a random Qwen3ForCausalLM with a byte tokenizer in ``path`` and returns ``path``."""
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    os.makedirs(path, exist_ok=True)
    tokenizer = build_byte_tokenizer(path)
    eos = tokenizer.eos_token_id
    config = Qwen3Config(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                         num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
                         num_key_value_heads=num_key_value_heads, head_dim=head_dim,
                         tie_word_embeddings=tie_word_embeddings, max_position_embeddings=max_position_embeddings,
                         rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
                         initializer_range=initializer_range, bos_token_id=eos, eos_token_id=eos, pad_token_id=eos)
    config.architectures = ["Qwen3ForCausalLM"]
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).to(dtype)
    with torch.no_grad():  # RMSNorm weights start at 1; randomize them too so a swapped norm shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    GenerationConfig(eos_token_id=[eos, tokenizer.convert_tokens_to_ids("<|im_end|>")],
                     bos_token_id=eos).save_pretrained(path)
    with open(os.path.join(path, "nanovllm_tiny.json"), "w") as f:
        json.dump({"random_weights": True, "seed": seed}, f)
    return path
