"""The one registry through which features reach the core. An entry is a "module:attribute" string
imported on first use, so the core names no feature and a plain run imports none. Kinds:

- ``model``: an architecture (config.json's ``architectures``) -> its model class
- ``feature``: a feature's name -> its ``Feature`` subclass; registered with what installs it
  (``keywords``: engine keywords; ``request_fields``: ``SamplingParams`` fields that are set)"""
from __future__ import annotations

import functools
import importlib


class Registry:
    def __init__(self):
        self.entries: dict[str, dict[str, tuple[str, dict]]] = {}  # kind -> name -> (target, meta)

    def register(self, kind: str, name: str, target: str, **meta) -> None:
        """``meta``: what is known of the entry without importing it."""
        self.entries.setdefault(kind, {})[name] = (target, meta)

    def names(self, kind: str) -> list[str]:
        return sorted(self.entries.get(kind, {}))

    def meta(self, kind: str, name: str) -> dict:
        return self.entries[kind][name][1]

    def get(self, kind: str, name: str):
        """The registered object, imported now; a ValueError lists the names ``kind`` has."""
        if name not in self.entries.get(kind, {}):
            raise ValueError(f"unknown {kind} {name!r}; registered: {self.names(kind)}")
        return _load(self.entries[kind][name][0])


@functools.cache
def _load(target: str):
    module, _, attribute = target.partition(":")
    return getattr(importlib.import_module(module), attribute)


REGISTRY = Registry()


class Feature:
    """A feature installed in an engine, on every rank, by an engine keyword or by a request. Its
    hooks all default to nothing; ``options`` are the keywords it took, ``config`` the engine's."""

    def __init__(self, config, options: dict):
        self.config, self.options = config, options

    @classmethod
    def verify_params(cls, params) -> None:
        """Checks its ``SamplingParams`` fields when the params are built (errors name them)."""

    def setup_runner(self, runner) -> None:
        """On every rank, before the model is built: ``runner.build_contexts`` (linear methods),
        ``runner.after_build``, ``runner.extensions`` (what a rank can be asked to do)."""

    def setup_engine(self, engine) -> None:
        """On rank 0 once the runners are built: logits hooks (``engine.core.hooks``), methods."""

    def check_request(self, params, engine) -> None:
        """An admission check of a request's verified ``SamplingParams`` (a ValueError refuses)."""


def features_of_params(params) -> list[str]:
    """The registered features whose request fields ``params`` sets (none is imported)."""
    return [name for name in REGISTRY.names("feature") if any(
        getattr(params, f, None) is not None
        for f in REGISTRY.meta("feature", name).get("request_fields", ()))]


def get_model_class(hf_config):
    """The registered model class of config.json's ``architectures``."""
    architectures = getattr(hf_config, "architectures", None) or []
    for arch in architectures:
        if arch in REGISTRY.names("model"):
            return REGISTRY.get("model", arch)
    raise ValueError(f"unsupported architecture(s) {architectures}; supported: "
                     f"{REGISTRY.names('model')}")
