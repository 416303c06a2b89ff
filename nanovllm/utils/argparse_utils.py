"""vLLM's ``vllm.utils.argparse_utils``, for scripts that take engine flags by
``EngineArgs.add_cli_args``."""
import argparse
import re
import sys


class FlexibleArgumentParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` that also takes a flag spelled with underscores
    (``--max_model_len=512``), as vLLM's."""

    def parse_known_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else args
        dashed = [re.sub(r"^--[^=]+", lambda flag: flag[0].replace("_", "-"), arg) for arg in args]
        return super().parse_known_args(dashed, namespace)
