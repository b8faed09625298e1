"""vllm_patches patch 4 (start-up only): the Qwen3 model class is inspected in this process, with the
same result vLLM's own subprocess inspection gives, and other architectures keep the subprocess."""

from __future__ import annotations

import pytest


@pytest.fixture
def registry(monkeypatch, tmp_path):
    from vllm.model_executor.models import registry

    from spirl.numerics import vllm_patches

    vllm_patches.apply()
    # a cache miss every time, and nothing written where a real run would look
    monkeypatch.setattr(registry._LazyRegisteredModel, "_get_cache_dir", staticmethod(lambda: tmp_path))
    return registry


def test_qwen3_is_inspected_in_process_with_the_subprocess_result(registry, monkeypatch):
    lazy = registry.ModelRegistry.models["Qwen3ForCausalLM"]
    reference = registry._run_in_subprocess(  # vLLM's path: a fresh interpreter inspects the class
        lambda: registry._ModelInfo.from_model_cls(lazy.load_model_cls()))

    def no_subprocess(*a, **k):
        raise AssertionError("patch 4 should inspect Qwen3 in this process")
    monkeypatch.setattr(registry.subprocess, "run", no_subprocess)
    assert lazy.inspect_model_cls() == reference  # the frozen dataclass compares every field
    assert registry._run_in_subprocess.__name__ == "_run_in_subprocess"  # restored after the call


def test_other_architectures_keep_the_subprocess(registry, monkeypatch):
    lazy = registry.ModelRegistry.models["LlamaForCausalLM"]
    ran = []

    def record(fn):
        ran.append(fn)
        return registry._ModelInfo.from_model_cls(lazy.load_model_cls())
    monkeypatch.setattr(registry, "_run_in_subprocess", record)
    lazy.inspect_model_cls()
    assert len(ran) == 1
