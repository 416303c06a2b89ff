"""vLLM's ``FlexibleArgumentParser`` (``vllm.utils.argparse_utils``), for scripts that build the engine from
command-line flags with ``EngineArgs.add_cli_args``."""
from __future__ import annotations

import argparse
import sys


class FlexibleArgumentParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` that also takes a flag spelled with underscores (``--max_model_len 512``,
    ``--max_model_len=512``) as its dashed name, as vLLM's does."""

    def parse_known_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else list(args)
        dashed = []
        for arg in args:
            if arg.startswith("--"):
                flag, sep, value = arg.partition("=")
                arg = flag.replace("_", "-") + sep + value
            dashed.append(arg)
        return super().parse_known_args(dashed, namespace)
