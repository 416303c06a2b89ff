"""Build flash-attn 2.8.3 from its PyPI sdist, trimmed to the bf16 head_dim-128 forward kernels
this engine calls, with torch.utils.cpp_extension.load for sm_90 (H100, H200), and import it from
the extracted sources without installing it: a short build (70 s on a 16-core H200 host) instead of
flash-attn's full one, and no network needed on the GPU machine.

The sdist goes into the folder git ignores, .gpu/ (or wherever FLASH_ATTN_SDIST points), fetched
once on any machine with PyPI:
    pip install wheel &&
    FLASH_ATTENTION_SKIP_CUDA_BUILD=TRUE pip download --no-deps --no-binary :all: \
        --no-build-isolation -d .gpu flash-attn==2.8.3

    python tools/gpu/flash_attn_build.py [--tarball PATH] [--dry-run]
        # build, then a smoke check against SDPA
"""
from __future__ import annotations

import argparse
import importlib
import itertools
import math
import os
import re
import shutil
import sys
import tarfile
import time
import types
from pathlib import Path

import torch
import torch.nn.functional as F

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TARBALL = Path(os.environ.get("FLASH_ATTN_SDIST")
                       or REPO_ROOT / ".gpu" / "flash_attn-2.8.3.tar.gz")
DEFAULT_BUILD_DIR = Path("/tmp/flash_attn_build")
EXTENSION_NAME = "flash_attn_2_cuda"

# The forward kernels the engine reaches: varlen prefill (non-split) and the paged paths (split),
# causal or not.
SOURCES = ["csrc/flash_attn/flash_api.cpp"] + [
    f"csrc/flash_attn/src/flash_fwd{split}_hdim128_bf16{causal}_sm80.cu"
    for split, causal in itertools.product(("", "_split"), ("", "_causal"))
]
INCLUDE_DIRS = ["csrc/flash_attn", "csrc/flash_attn/src", "csrc/cutlass/include"]
DEFINES = [
    f"-DFLASHATTENTION_DISABLE_{feature}"
    for feature in ("BACKWARD", "DROPOUT", "ALIBI", "SOFTCAP", "UNEVEN_K")
]  # local attention stays: sliding-window models (Mistral, Qwen2's windows) need it
CXX_FLAGS = ["-O3", "-std=c++17", *DEFINES]  # setup.py's "cxx" flags
# setup.py's nvcc_flags, with only Hopper's arch (sm_90: H100, H200) instead of its
# 80;90;100;120 list.
NVCC_FLAGS = [
    "-O3",
    "-std=c++17",
    "-U__CUDA_NO_HALF_OPERATORS__",
    "-U__CUDA_NO_HALF_CONVERSIONS__",
    "-U__CUDA_NO_HALF2_OPERATORS__",
    "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "--expt-relaxed-constexpr",
    "--expt-extended-lambda",
    "--use_fast_math",
    *DEFINES,
    "-gencode",
    "arch=compute_90,code=sm_90",
]

FP16_SWITCH_BF16_ONLY = (
    r"""#define FP16_SWITCH(COND, ...)                                                  \
  [&] {                                                                         \
    TORCH_CHECK(!(COND), "This flash attention build supports bf16 only.");     \
    using elem_type = cutlass::bfloat16_t;                                      \
    return __VA_ARGS__();                                                       \
  }()"""
)

HEADDIM_SWITCH_128_ONLY = (
    r"""#define HEADDIM_SWITCH(HEADDIM, ...)                                            \
  [&] {                                                                         \
    TORCH_CHECK(HEADDIM == 128, "This flash attention build supports head_dim 128 only, got ", """
    r"""HEADDIM); \
    constexpr static int kHeadDim = 128;                                        \
    return __VA_ARGS__();                                                       \
  }()"""
)

RUN_MHA_BWD_DISABLED = """void run_mha_bwd(Flash_bwd_params &params, cudaStream_t stream) {
    TORCH_CHECK(false, "This flash attention build does not support backward.");
}"""

# (file, what the edit does, pattern that must match exactly once, replacement)
EDITS = [
    (
        "csrc/flash_attn/src/static_switch.h",
        "FP16_SWITCH: bf16 only",
        r"^#define FP16_SWITCH\(COND, \.\.\.\).*?^  \}\(\)$",
        FP16_SWITCH_BF16_ONLY,
    ),
    (
        "csrc/flash_attn/src/static_switch.h",
        "HEADDIM_SWITCH: head_dim 128 only",
        r"^#define HEADDIM_SWITCH\(HEADDIM, \.\.\.\).*?^  \}\(\)$",
        HEADDIM_SWITCH_128_ONLY,
    ),
    (
        "csrc/flash_attn/flash_api.cpp",
        "run_mha_bwd: body replaced by an error (no backward kernels are compiled)",
        r"^void run_mha_bwd\(Flash_bwd_params &params, cudaStream_t stream\) \{$.*?^\}$",
        RUN_MHA_BWD_DISABLED,
    ),
]


def nvcc_flags() -> list[str]:
    """NVCC_FLAGS plus the ``--threads`` that setup.py's append_nvcc_threads adds."""
    return [*NVCC_FLAGS, "--threads", os.getenv("NVCC_THREADS") or "4"]


def extract(tarball: Path, build_dir: Path) -> Path:
    """Extracts the sdist afresh under build_dir and returns its root (the folder holding
    setup.py)."""
    if not tarball.is_file():
        raise FileNotFoundError(f"flash-attn sdist not found: {tarball}")
    with tarfile.open(tarball) as tar:
        tops = {Path(name).parts[0] for name in tar.getnames()}
        if len(tops) != 1:
            raise RuntimeError(f"{tarball}: expected one top-level folder, found {sorted(tops)}")
        root = build_dir / tops.pop()
        if root.exists():
            shutil.rmtree(root)
        build_dir.mkdir(parents=True, exist_ok=True)
        tar.extractall(build_dir, filter="data")
    if not (root / "setup.py").is_file():
        raise RuntimeError(f"{root} has no setup.py; is {tarball} the flash-attn sdist?")
    return root


def apply_edits(root: Path) -> None:
    """Applies EDITS to the extracted sources; raises if a pattern does not match exactly once."""
    for rel_path, description, pattern, replacement in EDITS:
        path = root / rel_path
        text = path.read_text()
        matches = list(re.finditer(pattern, text, flags=re.MULTILINE | re.DOTALL))
        if len(matches) != 1:
            raise RuntimeError(
                f"edit '{description}' expected exactly one match of {pattern!r} in {path}, "
                f"found {len(matches)}; "
                "the sdist is not the flash-attn 2.8.3 this script was written for"
            )
        path.write_text(text[: matches[0].start()] + replacement + text[matches[0].end() :])
        print(f"edited {rel_path}: {description}")


def prepare_sources(tarball: Path, build_dir: Path) -> Path:
    """Extracts and trims the sdist (once: a later call, in this process or another, reuses the
    trimmed sources untouched, so ninja does not recompile); returns its root after checking the
    sources exist."""
    trimmed = [p.parent for p in build_dir.glob("*/.nanovllm-trimmed")]
    if trimmed:
        root = trimmed[0]
    else:
        root = extract(tarball, build_dir)
        apply_edits(root)
        (root / ".nanovllm-trimmed").touch()
    missing = [rel for rel in SOURCES + INCLUDE_DIRS if not (root / rel).exists()]
    if missing:
        raise FileNotFoundError(f"missing from the extracted sdist at {root}: {missing}")
    return root


def import_flash_attn(root: Path, extension: types.ModuleType) -> types.ModuleType:
    """Registers the extension as flash_attn_2_cuda and imports the flash_attn package from the
    sdist at root."""
    sys.modules[EXTENSION_NAME] = extension
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    flash_attn = importlib.import_module("flash_attn")
    if not Path(flash_attn.__file__).resolve().is_relative_to(root.resolve()):
        raise ImportError(f"imported flash_attn from {flash_attn.__file__}, "
                          f"not from the sdist at {root}")
    return flash_attn


def load_flash_attn(
    tarball: str | os.PathLike | None = None, build_dir: str | os.PathLike | None = None,
    verbose: bool = False
) -> types.ModuleType:
    """Builds the trimmed flash-attn (unless this process already did) and returns the imported
    flash_attn module."""
    if EXTENSION_NAME in sys.modules and "flash_attn" in sys.modules:
        return sys.modules["flash_attn"]
    from torch.utils.cpp_extension import load

    build_dir = Path(build_dir or DEFAULT_BUILD_DIR)
    root = prepare_sources(Path(tarball or DEFAULT_TARBALL), build_dir)
    ninja_dir = build_dir / "build"
    ninja_dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("MAX_JOBS", "16")
    extension = load(
        name=EXTENSION_NAME,
        sources=[str(root / rel) for rel in SOURCES],
        extra_cflags=CXX_FLAGS,
        extra_cuda_cflags=nvcc_flags(),
        extra_include_paths=[str(root / rel) for rel in INCLUDE_DIRS],
        build_directory=str(ninja_dir),
        verbose=verbose,
    )
    return import_flash_attn(root, extension)


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               causal: bool) -> torch.Tensor:
    """fp32 SDPA for one sequence: q [Lq, H, D], k and v [Lk, Hkv, D] -> [Lq, H, D]."""
    group = q.shape[1] // k.shape[1]
    q, k, v = (x.float().transpose(0, 1)
               for x in (q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)))
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale).transpose(0, 1)


@torch.inference_mode()
def smoke_check(flash_attn: types.ModuleType) -> dict[str, float]:
    """Max abs error against fp32 SDPA of a causal varlen prefill and a paged decode, bf16,
    head_dim 128, GQA."""
    torch.manual_seed(0)
    device, dtype = "cuda", torch.bfloat16
    heads, kv_heads, head_dim = 16, 8, 128
    scale = head_dim**-0.5

    # Causal varlen prefill: the non-split kernels.
    lens = [1, 77, 300]
    bounds = [0, *itertools.accumulate(lens)]
    cu_seqlens = torch.tensor(bounds, dtype=torch.int32, device=device)
    q = torch.randn(bounds[-1], heads, head_dim, device=device, dtype=dtype)
    k, v = (torch.randn(bounds[-1], kv_heads, head_dim, device=device, dtype=dtype)
            for _ in range(2))
    out = flash_attn.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_seqlens,
                                            cu_seqlens_k=cu_seqlens,
                                            max_seqlen_q=max(lens), max_seqlen_k=max(lens),
                                            softmax_scale=scale, causal=True)
    ref = torch.cat([_reference(q[a:b], k[a:b], v[a:b], scale, causal=True)
                     for a, b in zip(bounds, bounds[1:])])
    errors = {"varlen prefill": (out.float() - ref).abs().max().item()}

    # Decode of one token per sequence against a paged cache of 256-token blocks: the split kernels.
    block_size, context_lens = 256, [1, 300, 700]
    blocks_per_seq = math.ceil(max(context_lens) / block_size)
    num_blocks = len(context_lens) * blocks_per_seq
    k_cache, v_cache = (torch.randn(num_blocks, block_size, kv_heads, head_dim, device=device,
                                    dtype=dtype)
                        for _ in range(2))
    block_table = (torch.randperm(num_blocks).to(device, torch.int32)
                   .view(len(context_lens), blocks_per_seq))
    q = torch.randn(len(context_lens), 1, heads, head_dim, device=device, dtype=dtype)
    out = flash_attn.flash_attn_with_kvcache(q, k_cache, v_cache,
                                             cache_seqlens=torch.tensor(context_lens,
                                                                        dtype=torch.int32,
                                                                        device=device),
                                             block_table=block_table, softmax_scale=scale,
                                             causal=True)
    ref = torch.stack([
        _reference(q[i], k_cache[block_table[i]].flatten(0, 1)[:n],
                   v_cache[block_table[i]].flatten(0, 1)[:n], scale, causal=False)
        for i, n in enumerate(context_lens)
    ])
    errors["paged decode"] = (out.float() - ref).abs().max().item()
    return errors


def dry_run(tarball: Path, build_dir: Path) -> None:
    """Everything before the compile: extraction, edits, the sources and flags, and the Python
    import with a stub."""
    root = prepare_sources(tarball, build_dir)
    print(f"sdist root: {root}")
    print("sources:", *(f"  {rel}" for rel in SOURCES), sep="\n")
    print("include dirs:", *(f"  {rel}" for rel in INCLUDE_DIRS), sep="\n")
    print("extra_cflags:", " ".join(CXX_FLAGS))
    print("extra_cuda_cflags:", " ".join(nvcc_flags()))
    print(f"MAX_JOBS={os.environ.get('MAX_JOBS', '16')}, build_directory={build_dir / 'build'}")
    # A stub extension: the import only needs flash_attn_2_cuda to exist; its functions are looked
    # up at call time.
    flash_attn = import_flash_attn(root, types.ModuleType(EXTENSION_NAME))
    from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache  # noqa: F401

    print(f"imported flash_attn {flash_attn.__version__} from {Path(flash_attn.__file__).parent} "
          f"with a stub {EXTENSION_NAME}: flash_attn_varlen_func and flash_attn_with_kvcache "
          "are available")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tarball", type=Path, default=DEFAULT_TARBALL,
                        help="the flash-attn 2.8.3 sdist")
    parser.add_argument("--build-dir", type=Path, default=DEFAULT_BUILD_DIR,
                        help="extraction and build folder")
    parser.add_argument("--verbose", action="store_true",
                        help="show the compiler commands and output")
    parser.add_argument("--dry-run", action="store_true",
                        help="extract, edit and list the sources; no compile")
    parser.add_argument("--tol", type=float, default=5e-2,
                        help="max abs error the smoke check accepts")
    args = parser.parse_args(argv)

    if args.dry_run:
        dry_run(args.tarball, args.build_dir)
        return 0
    if not torch.cuda.is_available():
        print("error: CUDA is not available", file=sys.stderr)
        return 1
    start = time.perf_counter()
    flash_attn = load_flash_attn(args.tarball, args.build_dir, args.verbose)
    print(f"built flash_attn {flash_attn.__version__} ({EXTENSION_NAME}) in "
          f"{time.perf_counter() - start:.1f} s "
          f"with torch {torch.__version__} on {torch.cuda.get_device_name()}")
    errors = smoke_check(flash_attn)
    for what, error in errors.items():
        print(f"{what}: max abs error vs fp32 SDPA {error:.2e}")
    if not all(error <= args.tol for error in errors.values()):  # NaN fails too
        print(f"error: smoke check failed (tolerance {args.tol})", file=sys.stderr)
        return 1
    print("smoke check passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
