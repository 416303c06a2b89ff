"""The three layers: a plain generate imports no feature, a feature arrives when a keyword or a
request asks for it, and the core's registry finds what features register."""
import json
import subprocess
import sys

import pytest

from nanovllm import LLM, SamplingParams
from nanovllm.plugins import REGISTRY, Feature, features_of_params

PLAIN = """
import json, sys
from nanovllm import LLM, SamplingParams
llm = LLM("nanovllm:demo")
llm.generate(["def add(a, b):"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
print(json.dumps(sorted(m for m in sys.modules if m.startswith("nanovllm."))))
"""
FEATURE_MODULES = ("nanovllm.features.", "nanovllm.logits_processor", "nanovllm.beam_search",
                   "nanovllm.v1", "nanovllm.distributed")


def loaded_by(code: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_plain_generate_imports_no_feature():
    modules = loaded_by(PLAIN)
    assert "nanovllm.engine.llm_engine" in modules  # the run happened
    assert [m for m in modules if m.startswith(FEATURE_MODULES)] == []


def test_a_request_installs_its_feature_on_first_use(demo_llm):
    assert "structured_outputs" not in demo_llm.features
    params = SamplingParams(max_tokens=4, allowed_token_ids=[1, 2, 3])
    assert features_of_params(params) == ["logits_processors"]
    out = demo_llm.generate(["x = "], params, use_tqdm=False)[0].outputs[0]
    assert set(out.token_ids) <= {1, 2, 3} and "logits_processors" in demo_llm.features


def test_features_register_by_name_and_unknown_ones_are_named():
    assert {"fp8", "sleep", "structured_outputs", "logits_processors", "metrics"} <= set(
        REGISTRY.names("feature"))
    assert issubclass(REGISTRY.get("feature", "sleep"), Feature)
    assert "Qwen3MoeForCausalLM" in REGISTRY.names("model")
    with pytest.raises(ValueError, match=r"unknown feature 'nope'; registered: \['fp8'"):
        REGISTRY.get("feature", "nope")


@pytest.fixture(scope="module")
def demo_llm():
    llm = LLM("nanovllm:demo", num_kvcache_blocks=16)
    yield llm
    llm.exit()
