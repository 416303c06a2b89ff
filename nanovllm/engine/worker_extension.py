"""vLLM's ``worker_extension_cls``: a class whose methods are mixed into every rank's worker (here the
``ModelRunner``), so that ``collective_rpc("its_method")`` runs them with the runner as ``self``."""
from __future__ import annotations

import functools
import logging

from nanovllm.logits_processor import import_by_name

logger = logging.getLogger("nanovllm")


def load_worker_extension(value) -> type | None:
    """``worker_extension_cls`` as a class: a class, or a "module.Class" / "module:Class" name; None or "" for
    none. A TypeError or ValueError names a value that is not one, or an attribute the runner has already."""
    if value is None or value == "":
        return None
    cls = import_by_name(value, f"worker_extension_cls={value!r}") if isinstance(value, str) else value
    if not isinstance(cls, type):
        raise TypeError(f"worker_extension_cls must be a class or a 'module.Class' name, got {value!r:.80}")
    if cls.__init__ is not object.__init__:
        raise ValueError(f"worker_extension_cls={cls.__qualname__} defines __init__, which the worker never calls: "
                         "set attributes in a method called through collective_rpc")
    from nanovllm.engine.model_runner import ModelRunner
    if clashes := sorted(name for name in dir(cls) if not name.startswith("__") and hasattr(ModelRunner, name)):
        raise ValueError(f"worker_extension_cls={cls.__qualname__}: attribute(s) {clashes} conflict with the "
                         "worker's (nanovllm's ModelRunner)")
    return cls


@functools.cache
def runner_class(extension: type | None) -> type:
    """The class each rank's runner is built from: ``ModelRunner``, or a subclass with ``extension``'s methods."""
    from nanovllm.engine.model_runner import ModelRunner
    if extension is None:
        return ModelRunner
    methods = sorted(name for name in dir(extension) if not name.startswith("__")
                     and callable(getattr(extension, name)))
    logger.debug("worker extension %s adds %s to ModelRunner", extension.__qualname__, methods)
    return type(f"ModelRunner[{extension.__qualname__}]", (ModelRunner, extension), {})
