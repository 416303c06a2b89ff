"""tools/profile_step.py's decoder-layer table on synthetic kernel traces, and its byte model."""
from __future__ import annotations

import os
import sys
from types import SimpleNamespace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools"))

from profile_step import decode_bytes, find_layer_block, kernel_kind, layer_table, markdown  # noqa: E402

from nanovllm.models.presets import preset_config  # noqa: E402

ADD_NORM = "triton_red_fused_add_mean_mul_pow_rsqrt_1"
# one unfused layer: (name, us, idle us before it); the qk_norm_rope kernel starts 1 us before the
# GEMM's end
LAYER = [(ADD_NORM, 4.0, 1.0), ("nvjet_tst_64x8_64x16_4x1_v_bz_TNT", 10.0, 2.0),
         ("_qk_norm_rope_store_kernel", 3.0, -1.0), ("_decode_kernel", 8.0, 1.5),
         ("sm90_xmma_gemm_bf16bf16_bf16f32", 6.0, 2.0), (ADD_NORM, 4.0, 1.0),
         ("nvjet_tst_128x8_64x12_2x1_v_bz_TNT", 20.0, 2.0),
         ("triton_poi_fused_mul_silu_2", 5.0, 1.0),
         ("cutlass_80_tensorop_bf16_s16816gemm_bf16_64x64_splitk", 12.0, 3.0)]


def trace(steps: list[list[tuple[str, float, float]]]) -> list[tuple[str, float, float]]:
    """(name, start, end) of kernels run back to back after their idle time, shuffled (the table
    sorts)."""
    events, t = [], 0.0
    for name, us, gap in (kernel for step in steps for kernel in step):
        t += gap
        events.append((name, t, t + us))
        t += us
    return events[::-1]


def decode_step(layer: list, layers: int, final_norm: tuple) -> list:
    first = [("triton_red_fused_mean_mul_pow_rsqrt_0",) + layer[0][1:]] \
        if kernel_kind(layer[0][0]) == "norm" else []
    return ([("Memcpy HtoD (Pinned -> Device)", 2.0, 20.0), ("embedding_kernel", 3.0, 1.0)] + first
            + layer[len(first):] + layer * (layers - 1)
            + [final_norm, ("nvjet_lm_head", 30.0, 1.0), ("_sample_chunks_kernel", 9.0, 1.0)])


def test_layer_table_finds_the_layer_block_roles_gaps_and_bandwidth():
    """Layer 0's input norm has no residual add (another kernel), so the block that repeats 3 times
    starts at the qkv GEMM and ends with the next layer's (or the final) norm; the table starts it
    at the norm."""
    events = trace([decode_step(LAYER, 3, LAYER[0])] * 2)
    names = [e[0] for e in sorted(events, key=lambda e: e[1])]
    assert find_layer_block(names, 3) == (3, 9)
    model = decode_bytes(preset_config("qwen3-0.6b"), batch=1, context=1024)
    table = layer_table(events, 3, model)
    assert table["period"] == 9 and table["occurrences"] == 6
    rows = table["kernels"]
    assert [r["role"] for r in rows] == ["input_layernorm", "qkv_proj", "qk_norm_rope_store",
                                         "attention", "o_proj", "post_attention_layernorm",
                                         "gate_up_proj", "silu_and_mul", "down_proj"]
    assert [r["name"] for r in rows] == [name for name, _, _ in LAYER]
    assert [r["us"] for r in rows] == [us for _, us, _ in LAYER]
    # the overlap clipped at 0
    assert [r["gap_us"] for r in rows] == [1.0, 2.0, 0.0, 1.5, 2.0, 1.0, 2.0, 1.0, 3.0]
    # qkv of Qwen3-0.6B at batch 1: 1024 x (2048 + 2 x 1024) weights + 1024 in + 4096 out, bf16,
    # in 10 us
    assert rows[1]["bytes"] == 8_398_848 and rows[1]["gb_per_s"] == 839.9
    assert all(r["bytes"] == model[r["role"]]
               and r["gb_per_s"] == round(model[r["role"]] / r["us"] / 1e3, 1)
               for r in rows)
    assert table["layer"] == dict(launches=9, us=72.0, gap_us=13.5, bytes=sum(model.values()),
                                  gb_per_s=round(sum(model.values()) / 72.0 / 1e3, 1))
    assert table["all_layers"] == dict(launches=27, us=216.0, gap_us=40.5)


def test_layer_table_of_fused_kernels_assigns_the_projections_in_order():
    """Norms fused into the GEMMs (no norm kernel in the layer), split-KV attention with its
    merge."""
    fused = [("_skinny_linear_kernel", 5.0, 1.0), ("_qk_norm_rope_store_kernel", 2.0, 1.0),
             ("_decode_kernel", 6.0, 1.0), ("_merge_kernel", 1.0, 1.0),
             ("_skinny_linear_kernel", 3.0, 1.0),
             ("_skinny_linear_kernel", 9.0, 1.0), ("_skinny_linear_kernel", 4.0, 1.0)]
    events = trace([decode_step(fused, 4, ("_rms_norm_kernel", 2.0, 1.0))] * 3)
    model = decode_bytes(preset_config("qwen3-8b"), batch=16, context=1024)
    table = layer_table(events, 4, model)
    assert table["period"] == 7 and table["start"] == 2 and table["occurrences"] == 12
    rows = table["kernels"]
    assert [r["role"] for r in rows] == ["qkv_proj", "qk_norm_rope_store", "attention",
                                         "attention_merge", "o_proj", "gate_up_proj", "down_proj"]
    assert rows[3]["bytes"] is None and rows[3]["gb_per_s"] is None  # the byte model has no merge
    assert rows[5]["bytes"] == (2 * 4096 * 12288 + 16 * 4096 + 2 * 16 * 12288) * 2
    # the norms' bytes too
    assert table["layer"]["us"] == 30.0 and table["layer"]["bytes"] == sum(model.values())
    text = markdown(dict(batch=16, context=1024, model_context=1101, layer_table=table))
    assert "| 5 | gate_up_proj | `_skinny_linear_kernel` | 9.0 | 1.0 | 202.24 MB | 22471.6 |" \
        in text.splitlines()
    assert text.count("\n") == 4 + 7 + 1
    assert "no repeating" in markdown(dict(batch=1, context=8))


def test_kernel_kind_prefers_attention_names_over_gemm_words():
    assert kernel_kind("void flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits<128, 64>>") \
        == "attention"
    assert kernel_kind("void flash_fwd_splitkv_combine_kernel<Flash_fwd_kernel_traits<128>>") \
        == "attention_merge"
    assert kernel_kind("void cutlass::Kernel2<"
                       "cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_32x32_128x1_tn>") == "gemm"
    assert kernel_kind("triton_red_fused_add_mean_mul_pow_rsqrt_1") == "norm"
    assert kernel_kind("void at::native::index_elementwise_kernel<128, 4>") == "other"


def test_decode_bytes_by_hand():
    """H 8, q 2 x 4, kv 1 x 4, I 16, batch 2, 10 tokens of context, 2 bytes."""
    config = SimpleNamespace(hidden_size=8, num_attention_heads=2, num_key_value_heads=1,
                             head_dim=4, intermediate_size=16)
    expected = dict(input_layernorm=4 * 2 * 8 * 2,                        # 128
                    qkv_proj=(8 * 16 + 2 * 8 + 2 * 16) * 2,                # 352
                    qk_norm_rope_store=(2 * 16 + 2 * 8 + 2 * 8) * 2,       # 128
                    attention=(2 * 10 * 8 + 2 * 8 + 2 * 8) * 2,            # 384
                    o_proj=(8 * 8 + 2 * 8 + 2 * 8) * 2,                    # 192
                    post_attention_layernorm=128,
                    gate_up_proj=(8 * 32 + 2 * 8 + 2 * 32) * 2,            # 672
                    silu_and_mul=(2 * 32 + 2 * 16) * 2,                    # 192
                    down_proj=(16 * 8 + 2 * 16 + 2 * 8) * 2)               # 352
    assert decode_bytes(config, batch=2, context=10) == expected
    # H // heads
    assert decode_bytes(SimpleNamespace(**dict(vars(config), head_dim=None)), 2, 10) == expected
    assert decode_bytes(config, 2, 10, dtype_bytes=4)["attention"] == 2 * 384
