"""Model names to local directories: ``nanovllm:<name>`` (the shipped models), presets, and Hugging
Face Hub ids (the local cache first, else a download unless HF_HUB_OFFLINE is set)."""
from __future__ import annotations

import logging
import os

import huggingface_hub
from huggingface_hub import constants
from huggingface_hub.utils import HFValidationError, validate_repo_id

from nanovllm.demo import PREFIX, builtin_model_path
from nanovllm.models.presets import PRESETS
from nanovllm.utils.loader import has_file

HUB_FILES = ("*.json", "*.txt", "*.model", "*.tiktoken", "*.jinja")  # fetched beside those needed
TRUE_VALUES = ("1", "ON", "YES", "TRUE")  # huggingface_hub's, for HF_HUB_OFFLINE

logger = logging.getLogger("nanovllm")


def resolve_model(name: str, needs: tuple[str, ...] = (), revision: str | None = None,
                  cache_dir: str | None = None, token: bool | str | None = None) -> str:
    """The local directory a model or tokenizer name stands for; a directory, a preset or a
    non-Hub name as is."""
    if name.startswith(PREFIX):
        return builtin_model_path(name)
    if os.path.isdir(name) or name in PRESETS:
        return name
    try:
        validate_repo_id(name)
    except HFValidationError:
        return name
    return hub_snapshot(name, needs, revision, cache_dir, token)


def hub_snapshot(repo_id: str, needs: tuple[str, ...] = (), revision: str | None = None,
                 cache_dir: str | None = None, token: bool | str | None = None) -> str:
    """``repo_id``'s snapshot with a file for each glob of ``needs``: the cache's, else a download
    unless HF_HUB_OFFLINE is set, else a ValueError saying how to get it."""
    kwargs = dict(revision=revision, cache_dir=cache_dir, token=token,
                  allow_patterns=[*HUB_FILES, *needs])
    try:
        path = huggingface_hub.snapshot_download(repo_id, local_files_only=True, **kwargs)
    except OSError:  # not cached, or a snapshot known to be incomplete
        problem = "is not in the local cache"
    else:
        if not (missing := [p for p in needs if not has_file(path, p)]):
            return path
        problem = f"has a snapshot without {', '.join(missing)} in the local cache"
    if constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").upper() in TRUE_VALUES:
        problem += " and HF_HUB_OFFLINE is set"
    else:
        logger.info("downloading %s from the Hugging Face Hub", repo_id)
        try:
            return huggingface_hub.snapshot_download(repo_id, **kwargs)
        except OSError as e:
            problem = (f"could not be downloaded ({type(e).__name__}: "
                       f"{str(e).strip().partition(chr(10))[0]})")
    at, option = (f" at revision {revision!r}", f" --revision {revision}") if revision else ("", "")
    raise ValueError(f"{repo_id!r} is not a local directory, and the Hugging Face Hub model{at} "
                     f"{problem}: run `hf download {repo_id}{option}` or pass a local "
                     "checkpoint's path") from None
