"""The shipped demo model (a tiny Qwen3 trained on the standard library's source, with its
tokenizer and held-out files), and the resolution of ``"nanovllm:<name>"`` model names."""
from __future__ import annotations

import os

DEMO_MODEL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "model")
DEMO_HELDOUT = os.path.join(DEMO_MODEL, "heldout")
DEMO_DRAFT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "draft")  # its 2-layer draft

BUILTIN_MODELS = {"nanovllm:demo": DEMO_MODEL, "nanovllm:demo-draft": DEMO_DRAFT}
PREFIX = "nanovllm:"


def builtin_model_path(model: str) -> str:
    """The directory of a built-in ``nanovllm:<name>`` model."""
    if model not in BUILTIN_MODELS:
        raise ValueError(f"unknown built-in model {model!r}; known: {sorted(BUILTIN_MODELS)}")
    path = BUILTIN_MODELS[model]
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"the files of built-in model {model!r} are missing from {path}")
    return path
