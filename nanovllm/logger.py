"""vLLM's ``vllm.logger.init_logger``, for scripts that log as vLLM's examples do."""
import logging


def init_logger(name: str) -> logging.Logger:
    """A logger under ``nanovllm``'s handler (INFO lines show by default, as in vLLM)."""
    return logging.getLogger("nanovllm" if name in ("vllm", "nanovllm") else f"nanovllm.{name}")
