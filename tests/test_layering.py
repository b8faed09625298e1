"""Imports run one way: kernels -> autograd ops -> model -> weights -> product -> verification.

Layer of each top-level name (a module may import its own layer or any layer below, never above):
    0  kernels/, batch_invariant_backward.py   kernels and their autograd wrappers
    1  torchtitan_compat/                        the model, its config, kernel backends, tokenizer
    2  weights.py, weights_vllm_compat.py        checkpoints and layouts
    3  spirl/                                    the trainer, engines, tasks
    4  compare/, simple_rl.py                    verification scripts and the entry point
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = {"kernels": 0, "batch_invariant_backward": 0, "torchtitan_compat": 1, "weights": 2,
          "weights_vllm_compat": 2, "spirl": 3, "compare": 4, "simple_rl": 4}


def _own_layer(path: Path) -> tuple[str, int]:
    top = path.relative_to(ROOT).parts[0].removesuffix(".py")
    return top, LAYERS[top]


def _imported_tops(path: Path) -> set[str]:
    tops = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            tops |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            tops.add(node.module.split(".")[0])
    return tops & set(LAYERS)


def _project_files() -> list[Path]:
    files = [ROOT / f"{name}.py" for name in LAYERS if (ROOT / f"{name}.py").is_file()]
    for name in LAYERS:
        if (ROOT / name).is_dir():
            files += sorted((ROOT / name).rglob("*.py"))
    return files


@pytest.mark.parametrize("path", _project_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_point_down(path):
    top, layer = _own_layer(path)
    upward = sorted(t for t in _imported_tops(path) if LAYERS[t] > layer)
    assert not upward, f"{path.relative_to(ROOT)} (layer {layer}, {top}) imports {upward} from a higher layer"


def test_every_project_package_has_a_layer():
    tops = {p.name.removesuffix(".py") for p in ROOT.iterdir()
            if (p.suffix == ".py" or (p / "__init__.py").is_file()) and p.name not in ("tests",)}
    assert tops <= set(LAYERS), f"give these a layer in tests/test_layering.py: {sorted(tops - set(LAYERS))}"
