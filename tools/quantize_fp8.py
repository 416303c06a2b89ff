"""Writes a block-wise fp8 copy of a bf16/fp32 checkpoint in the Qwen3-*-FP8 layout: every
q/k/v/o/gate/up/down projection's ``weight`` becomes float8_e4m3fn with a float32
``weight_scale_inv`` per block (the multiplier: each block's amax / 448); embeddings, lm_head and
norms are kept; config.json gets the ``quantization_config`` that nanovllm and vLLM read; tokenizer
and other files are copied.

    python tools/quantize_fp8.py SRC DST [--block 128]      # SRC: a directory or nanovllm:demo

DST must not be SRC or inside it, and SRC must not be quantized already; the copy is written into
DST.partial and renamed to DST once complete, so a failure leaves no half-written checkpoint.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from nanovllm.entrypoints.hub import resolve_model  # noqa: E402
from nanovllm.kernels.fp8_reference import quantize_fp8_block  # noqa: E402
from nanovllm.utils.loader import INDEX_FILE, checkpoint_files  # noqa: E402

PROJECTION = re.compile(r".*\.(q|k|v|o|gate|up|down)_proj\.weight")


def quantize_file(src: str, dst: str, block: tuple[int, int]) -> dict[str, str]:
    """Writes ``src``'s tensors to ``dst`` with the projections quantized; returns
    {tensor name: dst's name}."""
    tensors = {}
    with safe_open(src, "pt", "cpu") as f:
        for name in f.keys():
            tensor = f.get_tensor(name)
            if PROJECTION.fullmatch(name) and tensor.dim() == 2:
                tensors[name], tensors[name + "_scale_inv"] = quantize_fp8_block(tensor, block)
            else:
                tensors[name] = tensor
    save_file(tensors, dst, metadata={"format": "pt"})
    return dict.fromkeys(tensors, os.path.basename(dst))


def quantize_checkpoint(src: str, dst: str, block: int = 128) -> str:
    """``src`` (a directory or a built-in model) quantized into directory ``dst``; returns
    ``dst``."""
    src = resolve_model(src)
    real_src, real_dst = os.path.realpath(src), os.path.realpath(dst)
    if real_dst == real_src or real_dst.startswith(real_src + os.sep):
        raise ValueError(f"the destination {dst!r} is the source checkpoint or inside it: "
                         "choose another directory")
    if os.path.isdir(dst) and os.listdir(dst):
        raise ValueError(f"the destination {dst!r} is not empty")
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    if config.get("quantization_config") is not None:
        raise ValueError(f"{src!r} is already quantized (its config.json has a "
                         "quantization_config): quantize its bf16/fp32 checkpoint")
    work = f"{dst.rstrip(os.sep)}.partial"  # renamed into place once complete
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    _write(src, work, config, block)
    if os.path.isdir(dst) and not os.listdir(dst):
        os.rmdir(dst)  # an empty directory made for it
    os.rename(work, dst)
    return dst


def _write(src: str, dst: str, config: dict, block: int) -> None:
    files = checkpoint_files(src)
    weight_map = {}
    for file in files:
        weight_map.update(quantize_file(file, os.path.join(dst, os.path.basename(file)),
                                        (block, block)))
    for entry in os.listdir(src):
        path = os.path.join(src, entry)
        if (os.path.isfile(path) and not entry.endswith(".safetensors")
                and entry not in ("config.json", INDEX_FILE)):
            shutil.copy(path, os.path.join(dst, entry))
    if os.path.exists(os.path.join(src, INDEX_FILE)):
        with open(os.path.join(dst, INDEX_FILE), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=2)
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                     "activation_scheme": "dynamic",
                                     "weight_block_size": [block, block]}
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("src", help="a checkpoint directory or nanovllm:demo")
    parser.add_argument("dst", help="the directory to write")
    parser.add_argument("--block", type=int, default=128,
                        help="the square block's side (default 128)")
    args = parser.parse_args()
    if args.block < 1:
        parser.error(f"--block must be >= 1, got {args.block}")
    print(quantize_checkpoint(args.src, args.dst, args.block))


if __name__ == "__main__":
    main()
