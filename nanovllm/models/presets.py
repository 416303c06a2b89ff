"""Architecture presets: configs of real models built into the code, so benchmarks run with
``load_format="dummy"`` and no checkpoint (``LLM("qwen3-0.6b", load_format="dummy", ...)``)."""
from __future__ import annotations

from transformers import LlamaConfig, PretrainedConfig, Qwen2Config, Qwen3Config

PRESETS: dict[str, tuple[type[PretrainedConfig], dict]] = {
    # Qwen/Qwen3-0.6B's config.json (the shapes and rope; weights come from load_format="dummy")
    "qwen3-0.6b": (Qwen3Config, dict(
        architectures=["Qwen3ForCausalLM"], vocab_size=151936, hidden_size=1024, intermediate_size=3072,
        num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=True, attention_bias=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, bos_token_id=151643,
        eos_token_id=151645, dtype="bfloat16")),
    "qwen3-8b": (Qwen3Config, dict(
        architectures=["Qwen3ForCausalLM"], vocab_size=151936, hidden_size=4096, intermediate_size=12288,
        num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, bos_token_id=151643,
        eos_token_id=151645, dtype="bfloat16")),
    # meta-llama/Llama-3.2-1B
    "llama-3.2-1b": (LlamaConfig, dict(
        architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=2048, intermediate_size=8192,
        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
        max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        bos_token_id=128000, eos_token_id=[128001, 128008, 128009], dtype="bfloat16")),
    # meta-llama/Llama-3.1-8B
    "llama-3.1-8b": (LlamaConfig, dict(
        architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        bos_token_id=128000, eos_token_id=[128001, 128008, 128009], dtype="bfloat16")),
    # Qwen/Qwen2.5-7B-Instruct
    "qwen2.5-7b": (Qwen2Config, dict(
        architectures=["Qwen2ForCausalLM"], vocab_size=152064, hidden_size=3584, intermediate_size=18944,
        num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768,
        rms_norm_eps=1e-6, tie_word_embeddings=False, use_sliding_window=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, bos_token_id=151643,
        eos_token_id=151645, dtype="bfloat16")),
}


def preset_config(name: str) -> PretrainedConfig:
    config_class, fields = PRESETS[name]
    return config_class(**fields)
