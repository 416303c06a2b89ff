"""Builds tiny random checkpoints (Qwen3, Qwen2, Llama, Mistral, Qwen3-MoE) with a byte-level
tokenizer, offline.

Test code (not part of the package): the tests build their checkpoints with it, transformers being
the oracle.
"""
from __future__ import annotations

import json
import os

import torch

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
                 "{{ m['content'] }}<|im_end|>\n{% endfor %}"
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
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]


def build_tiny_qwen3(path: str, **kwargs) -> str:
    """Saves a random Qwen3ForCausalLM with a byte tokenizer in ``path`` and returns ``path``."""
    return build_tiny_model(path, "qwen3", **{"head_dim": 32, **kwargs})


ARCHITECTURES = {"qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
                 "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
                 "llama": ("LlamaConfig", "LlamaForCausalLM"),
                 "mistral": ("MistralConfig", "MistralForCausalLM"),
                 "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM")}


def build_tiny_model(path: str, arch: str = "qwen3", *, seed: int = 0, vocab_size: int = 320,
                     hidden_size: int = 64, intermediate_size: int = 128,
                     num_hidden_layers: int = 2, num_attention_heads: int = 4,
                     num_key_value_heads: int = 2, rope_theta: float = 10000.0,
                     rope_scaling: dict | None = None, max_position_embeddings: int = 1024,
                     initializer_range: float = 0.2, max_shard_size: str | None = None,
                     dtype: torch.dtype = torch.float32, **extra) -> str:
    """Saves a random model of one of ARCHITECTURES with a byte tokenizer in ``path``; ``extra``
    goes to the transformers config (head_dim, tie_word_embeddings, attention_bias, mlp_bias,
    sliding_window, num_experts...)."""
    import transformers
    from transformers import AutoModelForCausalLM, GenerationConfig

    config_name, arch_name = ARCHITECTURES[arch]
    os.makedirs(path, exist_ok=True)
    tokenizer = build_byte_tokenizer(path)
    eos = tokenizer.eos_token_id
    rope = {"rope_type": "default", "rope_theta": rope_theta, **(rope_scaling or {})}
    config = getattr(transformers, config_name)(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads, max_position_embeddings=max_position_embeddings,
        rope_parameters=rope, initializer_range=initializer_range, bos_token_id=eos,
        eos_token_id=eos, pad_token_id=eos, **extra)
    config.architectures = [arch_name]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(dtype)
    # RMSNorm weights start at 1, biases at 0: randomize them so a mix-up shows
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0.0, initializer_range)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    GenerationConfig(eos_token_id=[eos, tokenizer.convert_tokens_to_ids("<|im_end|>")],
                     bos_token_id=eos).save_pretrained(path)
    with open(os.path.join(path, "nanovllm_tiny.json"), "w") as f:
        json.dump({"random_weights": True, "seed": seed, "architecture": arch_name}, f)
    return path
