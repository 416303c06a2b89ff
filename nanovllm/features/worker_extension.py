"""vLLM's ``worker_extension_cls``, a feature: a class whose methods every rank's worker gets, so
that ``collective_rpc("its_method")`` runs them with the worker as ``self``. The worker here is a
view of the ``ModelRunner``: its own attributes first, then the runner's (``self.model_runner``
is the runner, as vLLM's workers hold theirs)."""
from __future__ import annotations

from nanovllm.engine.model_runner import ModelRunner
from nanovllm.features import import_by_name
from nanovllm.plugins import Feature


def load_worker_extension(value) -> type | None:
    """``worker_extension_cls`` as a class: a class, or a "module.Class" / "module:Class" name;
    None or "" for none. A TypeError or ValueError names a value that is not one, or an attribute
    the runner has already."""
    if value is None or value == "":
        return None
    what = f"worker_extension_cls={value!r}"
    cls = import_by_name(value, what) if isinstance(value, str) else value
    if not isinstance(cls, type):
        raise TypeError(f"worker_extension_cls must be a class or a 'module.Class' name, "
                        f"got {value!r:.80}")
    if cls.__init__ is not object.__init__:
        raise ValueError(f"worker_extension_cls={cls.__qualname__} defines __init__, which the "
                         "worker never calls: set attributes in a method called through "
                         "collective_rpc")
    refuse_clashes(cls, lambda name: hasattr(ModelRunner, name))
    return cls


def refuse_clashes(cls: type, taken) -> None:
    """A ValueError naming ``cls``'s attributes (dunders aside) for which ``taken(name)``."""
    if clashes := sorted(name for name in dir(cls) if not name.startswith("__") and taken(name)):
        raise ValueError(f"worker_extension_cls={cls.__qualname__}: attribute(s) {clashes} "
                         "conflict with the worker's (nanovllm's ModelRunner)")


class WorkerView:
    """A rank's worker as vLLM's extensions see it: ``model_runner``, then the runner's
    attributes."""

    def __init__(self, runner: ModelRunner):
        self.model_runner = runner

    def __getattr__(self, name: str):
        return getattr(self.__dict__["model_runner"], name)


class WorkerExtension(Feature):
    """The feature; ``options["worker_extension_cls"]``: the class or its name."""

    def __init__(self, config, options: dict):
        super().__init__(config, options)
        self.cls = load_worker_extension(options.get("worker_extension_cls"))

    def setup_runner(self, runner) -> None:
        bases = (self.cls, WorkerView) if self.cls is not None else (WorkerView,)
        runner.worker = type(f"Worker[{bases[0].__qualname__}]", bases, {})(runner)
        if self.cls is not None:  # the runner's instance attributes exist once it built its model
            runner.after_build.append(lambda model: self.check_instance(runner))

    def check_instance(self, runner) -> None:
        """A ValueError naming the extension's attributes that the runner instance has."""
        refuse_clashes(self.cls, lambda name: name in vars(runner))
