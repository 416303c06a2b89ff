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
        self.entries: dict[str, dict[str, str]] = {}  # kind -> name -> "module:attribute"
        self.meta: dict[tuple[str, str], dict] = {}  # what is known of an entry without importing it

    def register(self, kind: str, name: str, target: str, **meta) -> None:
        self.entries.setdefault(kind, {})[name] = target
        self.meta[kind, name] = meta

    def find(self, kind: str, key: str, value) -> list[str]:
        """The names of ``kind`` whose ``key`` metadata holds ``value``."""
        return [name for name in self.names(kind) if value in self.meta[kind, name].get(key, ())]

    def names(self, kind: str) -> list[str]:
        return sorted(self.entries.get(kind, {}))

    def meta_values(self, kind: str, key: str) -> set:
        """Every value that ``kind``'s entries list under ``key``."""
        return {v for name in self.names(kind) for v in self.meta[kind, name].get(key, ())}

    def get(self, kind: str, name: str):
        """The registered object, imported now; a ValueError lists the names ``kind`` has."""
        target = self.entries.get(kind, {}).get(name)
        if target is None:
            raise ValueError(f"unknown {kind} {name!r}; registered: {self.names(kind)}")
        return _load(target)


@functools.cache
def _load(target: str):
    module, _, attribute = target.partition(":")
    return getattr(importlib.import_module(module), attribute)


def import_by_name(value: str, what: str):
    """The object a "module.Name" or "module:Name" string names (vLLM's way to pass a class by
    name); a ValueError says why ``what`` cannot be imported."""
    module, _, name = value.rpartition(":" if ":" in value else ".")
    try:
        return functools.reduce(getattr, name.split("."), importlib.import_module(module))
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(f"{what} cannot be imported: {e}") from None


REGISTRY = Registry()


class Feature:
    """A feature installed in an engine, on every rank, by an engine keyword or by a request. Its
    hooks all default to nothing; ``options`` are the keywords it took, ``config`` the engine's."""

    def __init__(self, config, options: dict):
        self.config, self.options = config, options

    @classmethod
    def verify_params(cls, params) -> None:
        """Checks its ``SamplingParams`` fields when the params are built (a ValueError names one)."""

    def setup_runner(self, runner) -> None:
        """On every rank, before the model is built: ``runner.build_contexts`` (linear methods),
        ``runner.after_build``, ``runner.extensions`` (what a rank can be asked to do)."""

    def setup_engine(self, engine) -> None:
        """On rank 0 once the runners are built: logits hooks (``engine.core.hooks``), methods."""

    def check_request(self, params, engine) -> None:
        """An admission check of a request's verified ``SamplingParams`` (a ValueError refuses it)."""


def features_of_params(params) -> list[str]:
    """The registered features whose request fields ``params`` sets (none is imported)."""
    fields = [name for name in REGISTRY.meta_values("feature", "request_fields")
              if getattr(params, name, None) is not None]
    return sorted({f for name in fields for f in REGISTRY.find("feature", "request_fields", name)})


def get_model_class(hf_config):
    """The registered model class of config.json's ``architectures``."""
    architectures = getattr(hf_config, "architectures", None) or []
    for arch in architectures:
        if arch in REGISTRY.names("model"):
            return REGISTRY.get("model", arch)
    raise ValueError(f"unsupported architecture(s) {architectures}; supported: "
                     f"{REGISTRY.names('model')}")
