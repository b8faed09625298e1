"""Imports run one way: kernels -> autograd ops -> model -> weights -> product -> verification.

Layer of each top-level name (a module may import its own layer or any layer below, never above):
    0  kernels/, batch_invariant_backward.py   kernels and their autograd wrappers
    1  torchtitan_compat/                        the model, its config, kernel backends, tokenizer, LoRA
    2  weights.py, weights_vllm_compat.py        checkpoints and layouts
    3  spirl/                                    the product (its own groups below)
    4  compare/, simple_rl.py                    verification scripts and the entry point

Inside spirl/ (spirl/__init__.py), one package per group: spirl/core (policy, LoRA, optimizer, parity,
checkpoints, weight sync, memory plan) with spirl/engines; spirl/tasks; then the clients of the core,
which never import each other: spirl/loops (GRPO: trainer, run, evaluation; the warm start) and the
API (spirl/tinker).
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


SPIRL_GROUPS = {"core": {"core", "engines"}, "tasks": {"tasks"}, "loops": {"loops"}, "api": {"tinker"}}
"""Each group is one or more packages of spirl/ (spirl/__init__.py); nothing else lives there."""
MAY_IMPORT = {"core": {"core"}, "tasks": {"core", "tasks"}, "loops": {"core", "tasks", "loops"},
              "api": {"core", "tasks", "api"}}


def _spirl_group(name: str) -> str:
    top = name.split(".")[0]
    return next(g for g, members in SPIRL_GROUPS.items() if top in members)


def _spirl_imports(path: Path) -> set[str]:
    """spirl modules `path` imports (relative or absolute), as names inside spirl (`engines.base`)."""
    here = path.relative_to(ROOT / "spirl").with_suffix("").parts
    package = here[:-1] if here[-1] != "__init__" else here[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(package[:len(package) - node.level + 1])
                mod = ".".join(base + ([node.module] if node.module else []))
                names = [mod] if node.module else [".".join(base + [a.name]) for a in node.names]
            elif node.module and node.module.split(".")[0] == "spirl":
                names = [node.module.removeprefix("spirl").lstrip(".")] or []
                if not names[0]:
                    names = [a.name for a in node.names]
            else:
                continue
            out |= {n for n in names if n}
        elif isinstance(node, ast.Import):
            out |= {a.name.removeprefix("spirl.") for a in node.names if a.name.startswith("spirl.")}
    return out


@pytest.mark.parametrize("path", sorted((ROOT / "spirl").rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_spirl_groups_import_one_way(path):
    parts = path.relative_to(ROOT / "spirl").with_suffix("").parts
    if parts == ("__init__",):
        return
    mine = _spirl_group(parts[0])
    bad = sorted(n for n in _spirl_imports(path) if _spirl_group(n) not in MAY_IMPORT[mine])
    assert not bad, f"{path.relative_to(ROOT)} ({mine}) imports {bad}: {mine} may import only {sorted(MAY_IMPORT[mine])}"


def test_spirl_is_made_of_its_group_packages():
    entries = {p.name for p in (ROOT / "spirl").iterdir() if p.suffix == ".py" or (p / "__init__.py").is_file()}
    grouped = set().union(*SPIRL_GROUPS.values())
    assert entries - {"__init__.py"} <= grouped, (
        f"spirl/ holds only the group packages {sorted(grouped)}; move {sorted(entries - {'__init__.py'} - grouped)} into one")
    assert {p for p in grouped if (ROOT / "spirl" / p / "__init__.py").is_file()} == grouped
