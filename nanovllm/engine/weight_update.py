"""``LLMEngine.update_weights``: (checkpoint name, tensor) pairs checked, batched for the TP workers' shared memory,
and loaded in place through the parameters' weight loaders."""
from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from nanovllm.engine.sleep import check_awake
from nanovllm.engine.worker_group import UPDATE_BATCH_BYTES

# the devices whose TP ranks get update_weights' tensors by a broadcast over their group (NCCL: device to device);
# elsewhere through the call channel's shared memory
BROADCAST_DEVICES = ("cuda",)


def weight_list(weights) -> list[tuple[str, torch.Tensor]]:
    """``update_weights``' (name, tensor) pairs as a list, each tensor detached; a TypeError naming the first
    that is not a pair of a string and a floating-point tensor."""
    if isinstance(weights, (str, bytes, dict, torch.Tensor)) or not isinstance(weights, Iterable):
        hint = " (a state_dict: pass its .items())" if isinstance(weights, dict) else ""
        raise TypeError(f"weights must be an iterable of (name, tensor) pairs, got {type(weights).__name__}{hint}")
    checked = []
    for i, pair in enumerate(weights):
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2 and isinstance(pair[0], str)
                and isinstance(pair[1], torch.Tensor)):
            raise TypeError(f"weights[{i}] must be a (name, tensor) pair, got {pair!r:.80}")
        name, tensor = pair
        if not tensor.is_floating_point():
            raise TypeError(f"update_weights: tensor {name!r} is {tensor.dtype}: a floating-point tensor is needed")
        checked.append((name, tensor.detach()))
    return checked


def weight_batches(weights: list[tuple[str, torch.Tensor]], max_bytes: int) -> Iterator[list]:
    """``weights`` in consecutive batches of up to ``max_bytes`` of tensor data (a larger tensor alone)."""
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
    """``tensor`` on the CPU, owning no more storage than its own elements (a pickled view carries all of it)."""
    tensor = tensor.cpu()
    return tensor if tensor.untyped_storage().nbytes() == tensor.nbytes else tensor.clone()


def send_to_workers(engine, runner, workers, batch: list[tuple[str, torch.Tensor]]) -> list:
    """Starts the workers loading ``batch``: a broadcast from rank 0's device (CUDA), or shared memory (CPU).
    Returns the batch as rank 0 loads it."""
    call = engine.core.call_or_shut_down
    if engine.config.device in BROADCAST_DEVICES:
        batch = [(name, tensor.to(runner.device).contiguous()) for name, tensor in batch]
        call(workers.call, "receive_weights", [(name, tuple(tensor.shape), tensor.dtype) for name, tensor in batch])
        for _, tensor in batch:
            call(runner.group.broadcast, tensor, 0)
    else:
        call(workers.call, "update_weights", [(name, host_copy(tensor)) for name, tensor in batch])
    return batch


def update_weights(engine, weights) -> None:
    """``LLMEngine.update_weights``: every tensor checked on rank 0 by a dry run of its weight loader, then loaded
    batch by batch on every rank through the loaders (fusing, TP sharding, fp8 quantization, a cast to the model's
    dtype), in place. Refused while requests are unfinished (let them finish or abort them). Under TP every worker
    gets the full tensors UPDATE_BATCH_BYTES at a time: on CUDA by a broadcast from rank 0's device over the TP group
    (NCCL, device to device; the names, shapes and dtypes through the call channel), on CPU through shared memory.
    With one rank each tensor is copied from where it is straight into the parameter (no host round trip)."""
    weights = weight_list(weights)
    engine.core.drain_if_idle()
    with engine.core.lock:
        runner, workers = engine._resources.runner, engine._resources.workers
        if runner is None:
            raise RuntimeError("the engine has been shut down (exit() or a failure); create a new LLM")
        check_awake(runner, "update_weights()", ("weights",))
        if not engine.core.is_finished():
            scheduler = engine.core.scheduler
            raise ValueError(f"update_weights() while {len(scheduler.waiting) + len(scheduler.running)} "
                             "completions are unfinished: let them finish or abort them first")
        runner.check_weights(weights)
        if workers is None:  # one rank: each tensor copied from where it is into its parameter, in one pass
            engine.core.call_or_shut_down(runner.update_weights, weights, True)
        else:
            for batch in weight_batches(weights, UPDATE_BATCH_BYTES):
                batch = send_to_workers(engine, runner, workers, batch)
                engine.core.call_or_shut_down(runner.update_weights, batch, True)
        engine.core.scheduler.block_manager.reset_prefix_cache()
