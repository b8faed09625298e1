"""GPU tests: need CUDA and vLLM 0.26.0; skipped (not passed) otherwise.

Run them with:  VLLM_BATCH_INVARIANT=1 python -m pytest tests/gpu -m gpu -v
Checkpoints are written here by weights.py (random weights, real Qwen3 shapes, bf16).
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")


def _why_no_gpu() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        import vllm  # noqa: F401
    except ImportError:
        return "vLLM is not installed (pip install -e '.[gpu]')"
    if os.environ.get("VLLM_BATCH_INVARIANT") != "1":
        return "VLLM_BATCH_INVARIANT=1 must be set before Python starts"
    return None


def pytest_collection_modifyitems(config, items):
    reason = _why_no_gpu()
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(pytest.mark.gpu)
            if reason:
                item.add_marker(pytest.mark.skip(reason=f"GPU test: {reason}"))


def _write(tmp_path_factory, name, shape, layers=None):
    import weights

    out = tmp_path_factory.mktemp(name) / "ckpt"
    weights.write_random_checkpoint(out, shape, num_layers=layers, seed=0, dtype=torch.bfloat16)
    return str(out)


@pytest.fixture(scope="session")
def gpu_tiny_ckpt(tmp_path_factory):
    return _write(tmp_path_factory, "tiny", "tiny")


@pytest.fixture(scope="session")
def gpu_06b_4layer_ckpt(tmp_path_factory):
    return _write(tmp_path_factory, "q06", "Qwen3-0.6B", layers=4)


@pytest.fixture(scope="session")
def tiny_harness(gpu_tiny_ckpt):
    """One vLLM engine + trainer model on the tiny checkpoint, shared by the GPU tests (closed at the
    end, so vLLM's process group is destroyed before exit)."""
    from compare.harness import HarnessConfig, ParityHarness

    harness = ParityHarness(HarnessConfig(gpu_tiny_ckpt, gpu_memory_utilization=0.3))
    yield harness
    harness.close()
