"""Shared pytest fixtures: random Qwen3 checkpoints written once per test session, a scratch
directory per test module that is removed when the module is done, and Triton's interpreter in a
fresh process. Tests marked `slow` are left out of the default run (pyproject's addopts); the
closing summary says how many were, and how to run them."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # top-level modules (weights.py, ...) live in the repo root
    sys.path.insert(0, str(REPO_ROOT))

_slow_left_out: list[str] = []


def pytest_deselected(items):
    _slow_left_out.extend(item.nodeid for item in items if item.get_closest_marker("slow"))


def pytest_terminal_summary(terminalreporter):
    if n := len(_slow_left_out):
        terminalreporter.write_line(f"{n} slow test{'s' * (n > 1)} not run: `python -m pytest -m slow` runs them")


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> Path:
    """The `tiny` shape (2 layers, untied embeddings, real vocab), float32, seed 0."""
    from weights import write_random_checkpoint

    return write_random_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", "tiny", seed=0, dtype=torch.float32)


@pytest.fixture(scope="session")
def qwen06_2layer_ckpt(tmp_path_factory) -> Path:
    """Qwen3-0.6B's shape cut to 2 layers (tied embeddings), float32, seed 0."""
    from weights import write_random_checkpoint

    return write_random_checkpoint(tmp_path_factory.mktemp("ckpt") / "qwen06_2layer", "Qwen3-0.6B",
                                   num_layers=2, seed=0, dtype=torch.float32)


@pytest.fixture(scope="module")
def module_dir(request, tmp_path_factory) -> Path:
    """A directory for the runs one test module shares, removed when the module's tests are done.

    Why: every training step of the tiny model checkpoints 475 MB (float32 masters + AdamW state),
    and a module's runs add up to several GB; kept to the end of the session they filled CI's disk.
    Function-scoped `tmp_path`s are removed on success by `tmp_path_retention_policy` in
    pyproject.toml. Kept, like those, when a test of the module failed, to look at.
    """
    path = tmp_path_factory.mktemp(request.module.__name__.rsplit(".", 1)[-1])
    failed_before = request.session.testsfailed
    yield path
    if request.session.testsfailed == failed_before:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def triton_interpreter():
    """`run(*args, timeout=...)`: `python *args` in a fresh process with TRITON_INTERPRET=1, from the
    repository root; returns its stdout, and fails the test with the end of its stderr if it exits
    non-zero. A fresh process, because Triton reads the variable when `@triton.jit` defines a kernel:
    set in this process it would leak into every other test. Kernels run on the CPU there, with
    NumPy's arithmetic, so these checks are of indexing and math, never of GPU bits."""

    def run(*args: str, timeout: float) -> str:
        proc = subprocess.run([sys.executable, *args], cwd=REPO_ROOT, env={**os.environ, "TRITON_INTERPRET": "1"},
                              capture_output=True, text=True, timeout=timeout)
        assert proc.returncode == 0, f"interpreter process failed:\n{proc.stderr[-6000:]}"
        return proc.stdout

    return run
