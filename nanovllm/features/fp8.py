"""fp8 (e4m3) linear weights, a feature, vLLM's ``quantization="fp8"``: block-wise fp8 checkpoints
(the Qwen3-*-FP8 layout: ``weight`` in float8_e4m3fn with a float32 ``weight_scale_inv`` per 128x128
block, the multiplier despite its name) and online quantization of a bf16/fp32 checkpoint at load (a
scale per output channel, activations quantized per token). Both run W8A8 as vLLM does: activations
are quantized to e4m3 per token (online) or per token and group of the weight's block in K
(block-wise). On CUDA the forwards are ``kernels/triton_fp8.py``'s; the reference here, in plain
PyTorch, runs on CPU and emulates the same fp8 GEMM in float32."""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import threading

import torch
from torch import nn

from nanovllm import kernels
from nanovllm.kernels import reference
from nanovllm.kernels.fp8_reference import (  # noqa: F401 (re-exported: the quantizers)
    FP8,
    FP8_MAX,
    dequantize_fp8_block,
    fake_quantize_activations,
    quantize_fp8_block,
    quantize_fp8_per_channel,
)
from nanovllm.layers.linear import LinearBase, LinearMethod, linear_methods
from nanovllm.plugins import Feature

QUANTIZATION_METHODS = (None, "fp8")  # Config.quantization's values
FP8_GROUPS = (16, 32, 64, 128, 256, 512)  # the block sizes in K that the Triton kernels take

logger = logging.getLogger("nanovllm")


@dataclasses.dataclass(frozen=True)
class Fp8Config:
    """vLLM's ``Fp8Config``: a checkpoint's fp8 ``quantization_config``, or online quantization (not
    serialized)."""
    is_checkpoint_fp8_serialized: bool = False
    weight_block_size: tuple[int, int] | None = None
    ignored_layers: tuple[str, ...] = ()  # config.json's modules_to_not_convert

    @classmethod
    def from_config(cls, config: dict) -> Fp8Config:
        """From config.json's ``quantization_config``; what the reference forward cannot honour is
        refused."""
        if config.get("fmt", "e4m3") != "e4m3":
            raise ValueError(f"quantization_config fmt={config['fmt']!r} is not supported: "
                             "e4m3 only")
        if config.get("activation_scheme", "dynamic") != "dynamic":
            raise ValueError("quantization_config activation_scheme="
                             f"{config['activation_scheme']!r} is not supported: 'dynamic' only")
        block = config.get("weight_block_size")
        if block is None:
            raise ValueError("fp8 checkpoints without weight_block_size (per-tensor scales) are "
                             "not supported: block-wise ones only")
        if not (isinstance(block, (list, tuple)) and len(block) == 2
                and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
            raise ValueError("quantization_config weight_block_size must be two positive ints, "
                             f"got {block!r}")
        ignored = config.get("modules_to_not_convert") or config.get("ignored_layers") or ()
        if not (isinstance(ignored, (list, tuple)) and all(isinstance(m, str) for m in ignored)):
            raise ValueError("quantization_config modules_to_not_convert must be a list of names, "
                             f"got {ignored!r}")
        return cls(True, tuple(block), tuple(ignored))

    def get_quant_method(self, layer: nn.Module) -> Fp8LinearMethod | None:
        """The method of a linear layer; None for those built unquantized (the MoE router, as in
        vLLM)."""
        return Fp8LinearMethod(self) if getattr(layer, "quantizable", True) else None

    def is_layer_skipped(self, names: list[str]) -> bool:
        """Whether a layer of these checkpoint names (a packed layer's parts) stays unquantized, as
        transformers reads ``modules_to_not_convert``: a name containing an entry. Parts of one
        layer must agree."""
        skipped = [any(m in name for m in self.ignored_layers) for name in names]
        if any(skipped) and not all(skipped):
            raise ValueError(f"modules_to_not_convert skips some of {names} only: a packed layer "
                             "is all fp8 or none")
        return bool(skipped) and all(skipped)


def get_quantization_config(hf_config, quantization: str | None) -> Fp8Config | None:
    """The model's quantization: a checkpoint's ``quantization_config`` wins (``quantization`` None
    or "fp8" alike, as in vLLM); else ``quantization="fp8"`` quantizes a bf16/fp32 checkpoint at
    load."""
    if quantization not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization={quantization!r} is not supported: "
                         f"one of {QUANTIZATION_METHODS}")
    config = getattr(hf_config, "quantization_config", None)
    if config is None:
        if quantization is not None and getattr(hf_config, "num_experts", 0):
            logger.info("quantization='fp8' quantizes the dense projections; the MoE experts stay "
                        "unquantized")
        return None if quantization is None else Fp8Config()
    if not (isinstance(config, dict) or hasattr(config, "to_dict")):
        raise ValueError(f"the checkpoint's quantization_config must be a JSON object, "
                         f"got {config!r:.80}")
    config = config if isinstance(config, dict) else config.to_dict()
    if config.get("quant_method") != "fp8":
        raise ValueError("the checkpoint's quantization_config quant_method="
                         f"{config.get('quant_method')!r} is not supported: 'fp8' (block-wise) "
                         "only")
    return Fp8Config.from_config(config)


def check_scales(loaded: torch.Tensor) -> None:
    """Block scales must be finite and > 0: a NaN one makes every logprob NaN, every token 0."""
    ok = torch.isfinite(loaded) & (loaded > 0)
    if not bool(ok.all()):
        bad = loaded[~ok].flatten()[:3].tolist()
        raise ValueError(f"fp8 block scales must be finite and > 0, got {bad}")


def checked_scales(loader):
    """``loader`` for a scale tensor, which it checks first."""
    def load(param, loaded, *shard):
        check_scales(loaded)
        return loader(param, loaded, *shard)
    return load


def _param(data: torch.Tensor, loader, block: tuple[int, int | None] | None = None) -> nn.Parameter:
    param = nn.Parameter(data, requires_grad=False)
    param.weight_loader = loader
    if block is not None:
        param.block = block
    return param


class Fp8LinearMethod(LinearMethod):
    """Creates a linear layer's fp8 weight and scales, and runs its forward (``LinearBase`` calls
    these). A scale tensor's ``block``: how many weight rows and columns one of its elements covers
    (None: all columns)."""

    def __init__(self, quant_config: Fp8Config):
        self.quant_config = quant_config
        self.block = quant_config.weight_block_size

    def create_weights(self, layer: nn.Module):
        n, k = layer.weight.shape
        device = layer.weight.device
        if self.quant_config.is_checkpoint_fp8_serialized:
            layer.weight = _param(torch.empty(n, k, dtype=FP8, device=device), layer.weight_loader)
            scales = torch.empty(math.ceil(n / self.block[0]), math.ceil(k / self.block[1]),
                                 device=device)
            layer.weight_scale_inv = _param(scales.float(), checked_scales(layer.weight_loader),
                                            self.block)
        else:  # the scale is a buffer: it is loaded with the weight
            layer.weight = _param(torch.empty(n, k, dtype=FP8, device=device),
                                  lambda param, loaded, *shard: self.load_online(
                                      layer, param, loaded, *shard))
            layer.register_buffer("weight_scale",
                                  torch.ones(n, 1, dtype=torch.float32, device=device))
            layer.weight_scale.block = (1, None)

    @staticmethod
    def load_online(layer: nn.Module, param: nn.Parameter, loaded: torch.Tensor, *shard):
        """A bf16/fp32 checkpoint tensor quantized per output row, then loaded (and sharded) as an
        fp8 one."""
        if loaded.dtype == FP8:
            raise ValueError("is float8_e4m3fn but config.json has no fp8 quantization_config to "
                             "give its scales")
        q, scale = quantize_fp8_per_channel(loaded)
        layer.weight_loader(param, q, *shard)
        layer.weight_loader(layer.weight_scale, scale, *shard)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None,
              residual: torch.Tensor | None, silu_mul: bool) -> torch.Tensor:
        """The layer's ``linear``, W8A8: x quantized per token (online) or per token and group of bk
        columns (block-wise). On CUDA ``triton_fp8``'s kernels; else the reference, the fp8 GEMM
        emulated in float32."""
        serialized = self.quant_config.is_checkpoint_fp8_serialized
        scale, block = ((layer.weight_scale_inv, self.block) if serialized
                        else (layer.weight_scale, None))
        fp8 = kernels.ops_for(x, "triton_fp8", None)
        if (fp8 is not None and x.dim() == 2 and x.stride(-1) == 1
                and (block is None or block[1] in FP8_GROUPS)):
            return fp8.fp8_linear(x, layer.weight, scale, block, bias, residual=residual,
                                  silu_mul=silu_mul)
        x2 = x.reshape(-1, x.size(-1))
        x_dq = fake_quantize_activations(x2, x2.size(1) if block is None else block[1])
        w = dequantize_fp8_block(layer.weight, scale, block or (1, layer.weight.size(1)))
        y = reference.linear(x_dq, w, None if bias is None else bias.float(), silu_mul=silu_mul)
        y = y.to(x.dtype).view(*x.shape[:-1], y.size(-1))
        return y if residual is None else residual.add_(y)


class _QuantState(threading.local):
    config: Fp8Config | None = None


_QUANT = _QuantState()


def get_quant_config() -> Fp8Config | None:
    """The fp8 quantization of the model this thread builds (None: unquantized)."""
    return _QUANT.config


@contextlib.contextmanager
def quantization(config: Fp8Config | None):
    """Layers built inside take ``config``'s quantization, as ``tensor_parallel`` gives them
    their rank."""
    previous, _QUANT.config = _QUANT.config, config
    try:
        with linear_methods(None if config is None else config.get_quant_method):
            yield
    finally:
        _QUANT.config = previous


def _unquantize(layer: LinearBase):
    """Back to a plain weight in the default dtype (a layer ``modules_to_not_convert`` names)."""
    layer.weight = nn.Parameter(torch.empty(layer.weight.shape, device=layer.weight.device),
                                requires_grad=False)
    layer.weight.weight_loader = layer.weight_loader
    for name in ("weight_scale_inv", "weight_scale"):
        if hasattr(layer, name):
            delattr(layer, name)
    layer.quant_method = LinearMethod()


def skip_unconverted_layers(model: nn.Module, config: Fp8Config | None):
    """Rebuilds unquantized the linear layers that ``modules_to_not_convert`` names (known by name
    only once built)."""
    if config is None or not config.ignored_layers:
        return
    packed = getattr(model, "packed_modules_mapping", {})
    for prefix, module in model.named_modules():
        if not isinstance(getattr(module, "quant_method", None), Fp8LinearMethod):
            continue
        name = prefix.rpartition(".")[2]
        parts = [f"{prefix[:-len(name)]}{ckpt}" for ckpt, (target, _) in packed.items()
                 if target == name]
        if config.is_layer_skipped(parts or [prefix]):
            _unquantize(module)


class Fp8(Feature):
    """The feature: ``quantization="fp8"`` or a checkpoint's fp8 ``quantization_config``; every
    rank builds its linear layers (and MoE experts) with fp8 weights."""

    def __init__(self, config, options: dict):
        super().__init__(config, options)
        self.quant_config = get_quantization_config(config.hf_config, options.get("quantization"))

    def setup_runner(self, runner) -> None:
        runner.build_contexts.append(lambda: quantization(self.quant_config))
        runner.after_build.append(lambda model: skip_unconverted_layers(model, self.quant_config))
