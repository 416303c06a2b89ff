"""tools/bench_rl.py's CPU smoke run on the demo model: every measurement is written as a JSON line,
the outputs after wake_up equal those before sleep, and the engine's logprobs equal transformers' on
the pushed weights."""
from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_rl_runs_on_cpu(tmp_path):
    out = tmp_path / "rl.jsonl"
    subprocess.run([sys.executable, os.path.join(ROOT, "tools", "bench_rl.py"), "--device", "cpu",
                    "--model", "nanovllm:demo", "--threads", "1", "--repeats", "2",
                    "--max-num-seqs", "8", "--logprob-gap", "--out", str(out)], check=True,
                   cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True,
                   timeout=300)
    records = {r["metric"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert list(records) == ["startup", "update_weights", "sleep", "logprob_gap", "wake_up",
                             "rl_cycle"]
    assert (records["update_weights"]["tensors"] == 46
            and len(records["update_weights"]["all_seconds"]) == 2)
    assert records["wake_up"]["same_outputs_as_before_sleep"] is True
    assert (records["logprob_gap"]["float32"]["max"] < 1e-4
            and records["logprob_gap"]["float32"]["tokens"] == 256)
    assert records["rl_cycle"]["seconds"] > 0
