"""Run a script or module with flash-attn importable: the installed package if there is one, else
the trimmed build of flash_attn_build.py (from the sdist in .gpu/ or FLASH_ATTN_SDIST):
``python3 tools/gpu/with_flash_attn.py bench.py --attention-backend flash-attn`` or
``... -m pytest tests``."""
import runpy
import sys
import time

from flash_attn_build import load_flash_attn

start = time.time()
try:
    import flash_attn  # noqa: F401  (an installed flash-attn)
except ImportError:
    load_flash_attn()
    print(f"flash-attn built and ready in {time.time() - start:.0f} s", file=sys.stderr)
if sys.argv[1] == "-m":
    sys.argv = sys.argv[2:]
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
else:
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
