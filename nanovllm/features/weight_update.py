"""``LLM.update_weights``, a feature of the RL surface: (checkpoint name, tensor) pairs checked,
batched for the TP workers' shared memory, and loaded in place through the parameters' weight
loaders on every rank."""
from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from nanovllm.features.sleep import check_awake
from nanovllm.layers.linear import QUANTIZED_DTYPES, ShapeChecked, shapes_only
from nanovllm.utils.loader import SKIPPED_TENSORS, _load_one, target_resolver

UPDATE_BATCH_BYTES = 32 * 2 ** 20  # the tensors of one call to the workers (a larger one alone)

# the devices whose TP ranks get update_weights' tensors by a broadcast over their group (NCCL:
# device to device); elsewhere through the call channel's shared memory
BROADCAST_DEVICES = ("cuda",)


def weight_list(weights) -> list[tuple[str, torch.Tensor]]:
    """``update_weights``' (name, tensor) pairs as a list, each tensor detached; a TypeError naming
    the first that is not a pair of a string and a floating-point tensor."""
    if isinstance(weights, (str, bytes, dict, torch.Tensor)) or not isinstance(weights, Iterable):
        hint = " (a state_dict: pass its .items())" if isinstance(weights, dict) else ""
        raise TypeError("weights must be an iterable of (name, tensor) pairs, "
                        f"got {type(weights).__name__}{hint}")
    checked = []
    for i, pair in enumerate(weights):
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2 and isinstance(pair[0], str)
                and isinstance(pair[1], torch.Tensor)):
            raise TypeError(f"weights[{i}] must be a (name, tensor) pair, got {pair!r:.80}")
        name, tensor = pair
        if not tensor.is_floating_point():
            raise TypeError(f"update_weights: tensor {name!r} is {tensor.dtype}: "
                            "a floating-point tensor is needed")
        if tensor.is_meta or tensor.layout != torch.strided:
            where = "on the meta device" if tensor.is_meta else f"of layout {tensor.layout}"
            raise TypeError(f"update_weights: tensor {name!r} is {where}: a dense tensor with "
                            "values is needed")
        checked.append((name, tensor.detach()))
    return checked


def weight_batches(weights: list[tuple[str, torch.Tensor]], max_bytes: int) -> Iterator[list]:
    """``weights`` in consecutive batches of up to ``max_bytes`` of tensor data (a larger tensor
    alone)."""
    batch, size = [], 0
    for name, tensor in weights:
        if batch and size + tensor.nbytes > max_bytes:
            yield batch
            batch, size = [], 0
        batch.append((name, tensor))
        size += tensor.nbytes
    if batch:
        yield batch


def host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` on the CPU, owning no more storage than its own elements (a pickled view carries
    all of it)."""
    tensor = tensor.cpu()
    return tensor if tensor.untyped_storage().nbytes() == tensor.nbytes else tensor.clone()


def send_to_workers(engine, runner, workers, batch: list[tuple[str, torch.Tensor]]) -> list:
    """Starts the workers loading ``batch``: a broadcast from rank 0's device (CUDA), or shared
    memory (CPU). Returns the batch as rank 0 loads it."""
    call = engine.core.call_or_shut_down
    if engine.config.device in BROADCAST_DEVICES:
        batch = [(name, tensor.to(runner.device).contiguous()) for name, tensor in batch]
        specs = [(name, tuple(tensor.shape), tensor.dtype) for name, tensor in batch]
        call(workers.call, receive_weights, specs)
        for _, tensor in batch:
            call(runner.group.broadcast, tensor, 0)
    else:  # through the call channel (float8 tensors travel as bytes there)
        call(workers.call, load_weights, [(name, host_copy(t)) for name, t in batch])
    return batch


def load_weights(runner, weights: list[tuple[str, torch.Tensor]]):
    """A rank's part: the (checked) tensors loaded into its part of the model."""
    update_weights_in(runner.model, weights)


def receive_weights(runner, specs: list[tuple[str, tuple[int, ...], torch.dtype]]):
    """A worker's part on CUDA: each (name, shape, dtype) tensor received from rank 0's broadcast
    (device to device), then loaded (rank 0 checked them)."""
    weights = [(name, torch.empty(shape, dtype=dtype, device=runner.device))
               for name, shape, dtype in specs]
    for _, tensor in weights:
        runner.group.broadcast(tensor, 0)
    update_weights_in(runner.model, weights)


def update_weights(engine, weights) -> None:
    """``LLMEngine.update_weights``: every tensor checked on rank 0 by a dry run of its weight
    loader, then loaded batch by batch on every rank through the loaders (fusing, TP sharding, fp8
    quantization, a cast to the model's dtype), in place. Refused while requests are unfinished (let
    them finish or abort them). Under TP every worker gets the full tensors UPDATE_BATCH_BYTES at a
    time: on CUDA by a broadcast from rank 0's device over the TP group (NCCL, device to device; the
    names, shapes and dtypes through the call channel), on CPU through shared memory. With one rank
    each tensor is copied from where it is straight into the parameter (no host round trip)."""
    weights = weight_list(weights)
    engine.core.drain_if_idle()
    with engine.core.lock:
        engine._resources.check_open()
        runner, workers = engine._resources.runner, engine._resources.workers
        check_awake(runner, "update_weights()", ("weights",))
        if not engine.core.is_finished():
            scheduler = engine.core.scheduler
            raise ValueError("update_weights() while "
                             f"{len(scheduler.waiting) + len(scheduler.running)} completions are "
                             "unfinished: let them finish or abort them first")
        check_weights(runner.model, weights)
        if workers is None:  # one rank: each tensor copied from where it is into its parameter
            engine.core.call_or_shut_down(load_weights, runner, weights)
        else:
            for batch in weight_batches(weights, UPDATE_BATCH_BYTES):
                batch = send_to_workers(engine, runner, workers, batch)
                engine.core.call_or_shut_down(load_weights, runner, batch)
        engine.core.scheduler.block_manager.reset_prefix_cache()

def _weight_targets(model: nn.Module,
                    weights: list[tuple[str, torch.Tensor]]) -> list[tuple | None]:
    """(parameter, weight_loader's extra arguments) of each named tensor, None for one skipped as
    ``load_model`` skips it; a ValueError naming the first that matches no parameter."""
    resolve = target_resolver(model)
    params = dict(model.named_parameters(remove_duplicate=False))
    packed_names = {packed for packed, _ in getattr(model, "packed_modules_mapping", {}).values()}
    targets = []
    for name, tensor in weights:
        if name.endswith(SKIPPED_TENSORS):
            targets.append(None)
            continue
        target, shard_args = resolve(name)
        if target not in params:
            raise ValueError(f"update_weights: tensor {name!r} matches no parameter of "
                             f"{type(model).__name__}")
        if not shard_args and any(f".{packed}." in f".{name}" for packed in packed_names):
            raise ValueError(f"update_weights: tensor {name!r} is this engine's packed parameter: "
                             "pass its parts under the checkpoint's names (q_proj/k_proj/v_proj, "
                             "gate_proj/up_proj), as a transformers model's named_parameters() "
                             "gives them")
        if tensor.dtype in QUANTIZED_DTYPES and params[target].dtype not in QUANTIZED_DTYPES:
            raise ValueError(f"update_weights: tensor {name!r} is {tensor.dtype} but the model "
                             f"expects {params[target].dtype}: the model is not fp8 here")
        targets.append((params[target], shard_args))
    return targets


@torch.no_grad()
def check_weights(model: nn.Module, weights: list[tuple[str, torch.Tensor]]):
    """A dry run of ``update_weights``: a ValueError naming the first tensor whose name matches no
    parameter, or whose dtype or shape its weight loader refuses; nothing is written."""
    with shapes_only():
        for (name, tensor), target in zip(weights, _weight_targets(model, weights)):
            if target is None:
                continue
            try:
                _load_one(*target, tensor)
            except ShapeChecked:
                continue
            except ValueError as e:
                raise ValueError(f"update_weights: tensor {name!r}: {e}") from None
            raise RuntimeError(f"the weight loader of {name!r} wrote without checking its shape")


@torch.no_grad()
def update_weights_in(model: nn.Module, weights: list[tuple[str, torch.Tensor]]):
    """Copies (checkpoint name, tensor) pairs into ``model``'s parameters through their weight
    loaders (packing, sharding, fp8 quantization, a cast to the parameter's dtype), in place: every
    parameter keeps its storage. Unchecked: a refused tensor could leave the ones before it loaded,
    so ``check_weights`` runs first."""
    for (_, tensor), target in zip(weights, _weight_targets(model, weights)):
        if target is not None:
            _load_one(*target, tensor)



