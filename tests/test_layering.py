"""Imports run one way: kernels -> autograd ops -> model -> weights -> product -> verification, with no
circle anywhere in the tree.

Layer of each top-level name (a module may import its own layer or any layer below, never above):
    0  spirl_kernels/, batch_invariant_backward.py   kernels and their autograd wrappers
    1  torchtitan_compat/                        the model, its config, kernel backends, tokenizer, LoRA
    2  weights.py, weights_vllm_compat.py        checkpoints and layouts
    3  spirl/                                    the product (its own groups below)
    4  compare/, simple_rl.py                    verification scripts and the entry point

Inside spirl/ (spirl/__init__.py), one package per group, lowest first: spirl/numerics (what engines and
the trainer share: samples, trajectories, sampling distributions, logprob and parity kernels, vLLM
patches), spirl/engines, spirl/core (the policy: weights, compute model, optimizer, LoRA, sync, resume;
checkpoints, config, preflight), spirl/tasks; then the clients of the core, which never import each
other: spirl/loops (GRPO: trainer, run, evaluation; the warm start) and the API (spirl/tinker).

The import graph is of the whole tree (tests/ and compare/ included): one node per module, one edge per
project module a module imports, at its top or inside a function (a function-level import closes a
circle as surely as a top-level one, only later).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = {"spirl_kernels": 0, "batch_invariant_backward": 0, "torchtitan_compat": 1, "weights": 2,
          "weights_vllm_compat": 2, "spirl": 3, "compare": 4, "simple_rl": 4}
NOT_SOURCE = {"docs", "runs", "build", "dist"}
"""Top-level directories that hold no project source (besides hidden ones, virtual environments and
*.egg-info)."""


# -- the import graph of the whole tree ------------------------------------------------------------------


def source_files(root: Path = ROOT) -> dict[str, Path]:
    """Module name -> file of every Python file of the tree (`spirl.core.policy`, `tests.test_lora`)."""
    out = {}
    for p in sorted(root.rglob("*.py")):
        parts = p.relative_to(root).with_suffix("").parts
        top = parts[0]
        if top.startswith(".") or top in NOT_SOURCE or top.endswith(".egg-info") or (root / top / "pyvenv.cfg").is_file():
            continue
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def _known(name: str, modules) -> str | None:
    """The module `name` names, or the longest package prefix of it that is one (`import a.b` runs a)."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in modules:
            return ".".join(parts[:n])
    return None


def imports_of(name: str, path: Path, modules) -> set[str]:
    """The project modules the module `name` imports, anywhere in its file."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {_known(a.name, modules) for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                src = ".".join(base + ([node.module] if node.module else []))
            else:
                src = node.module or ""
            for a in node.names:  # `from pkg import mod` imports the module, `from mod import f` the module
                sub = f"{src}.{a.name}" if src else a.name
                out.add(sub if sub in modules else _known(src, modules))
    out.discard(None)
    out.discard(name)
    return out


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    modules = source_files(root)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every circle of the graph: its strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]  # iterative: no recursion limit on long chains
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


GRAPH = import_graph()


def test_no_import_cycle_anywhere():
    circles = cycles(GRAPH)
    assert not circles, ("import circles (top-level and function-level imports both count; move what both "
                         f"sides need into a module below them): {circles}")


def test_cycle_finder_sees_function_level_imports(tmp_path):
    """A circle closed only by an import inside a function, in a package, is found (and its absence too)."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "a.py").write_text("from .b import f\n")
    (tmp_path / "pkg" / "b.py").write_text("def f():\n    from pkg import a\n    return a\n")
    (tmp_path / "c.py").write_text("import pkg.a\n")
    graph = import_graph(tmp_path)
    assert graph["c"] == {"pkg.a"} and graph["pkg.b"] == {"pkg.a"}
    assert cycles(graph) == [["pkg.a", "pkg.b"]]
    (tmp_path / "pkg" / "b.py").write_text("def f():\n    return 1\n")
    assert cycles(import_graph(tmp_path)) == []


# -- layers of the top-level names ------------------------------------------------------------------------


def _layered(name: str) -> bool:
    return name.split(".")[0] in LAYERS


@pytest.mark.parametrize("name", sorted(n for n in GRAPH if _layered(n)))
def test_imports_point_down(name):
    top, layer = name.split(".")[0], LAYERS[name.split(".")[0]]
    upward = sorted(m for m in GRAPH[name] if _layered(m) and LAYERS[m.split(".")[0]] > layer)
    assert not upward, f"{name} (layer {layer}, {top}) imports {upward} from a higher layer"


def test_every_project_package_has_a_layer():
    tops = {p.name.removesuffix(".py") for p in ROOT.iterdir()
            if (p.suffix == ".py" or (p / "__init__.py").is_file()) and p.name not in ("tests",)}
    assert tops <= set(LAYERS), f"give these a layer in tests/test_layering.py: {sorted(tops - set(LAYERS))}"


THIRD_PARTY_TOPS = {"kernels", "vllm", "torch", "triton", "transformers", "trl", "peft", "tinker", "tinker_cookbook",
                    "datasets", "safetensors", "huggingface_hub", "accelerate", "torchtitan", "reasoning_gym",
                    "math_verify", "tensorboard"}
"""Top-level modules of the libraries the project runs beside. `kernels` is Hugging Face's kernel hub package,
which transformers and TRL import (`from kernels import get_kernel`): a project package of that name, first on
sys.path from the checkout and installed as a top-level package by pip, would stand in its place."""


def test_no_project_package_shadows_a_library():
    tops = {name.split(".")[0] for name in source_files()}
    assert not tops & THIRD_PARTY_TOPS, f"rename these project packages: {sorted(tops & THIRD_PARTY_TOPS)}"


# -- the groups of spirl/ -----------------------------------------------------------------------------------

SPIRL_GROUPS = {"numerics": {"numerics"}, "engines": {"engines"}, "core": {"core"}, "tasks": {"tasks"},
                "loops": {"loops"}, "api": {"tinker"}}
"""Each group is one or more packages of spirl/ (spirl/__init__.py); nothing else lives there."""
MAY_IMPORT = {"numerics": {"numerics"},
              "engines": {"numerics", "engines"},
              "core": {"numerics", "engines", "core"},
              "tasks": {"numerics", "core", "tasks"},
              "loops": {"numerics", "engines", "core", "tasks", "loops"},
              "api": {"numerics", "engines", "core", "tasks", "api"}}


def _spirl_group(name: str) -> str | None:
    """The group of a spirl module (`spirl.core.policy` -> core); None for spirl/__init__.py."""
    parts = name.split(".")
    if len(parts) < 2:
        return None
    return next(g for g, members in SPIRL_GROUPS.items() if parts[1] in members)


@pytest.mark.parametrize("name", sorted(n for n in GRAPH if n.startswith("spirl.")))
def test_spirl_groups_import_one_way(name):
    mine = _spirl_group(name)
    bad = sorted(m for m in GRAPH[name] if m.startswith("spirl.") and _spirl_group(m) not in MAY_IMPORT[mine])
    assert not bad, f"{name} ({mine}) imports {bad}: {mine} may import only {sorted(MAY_IMPORT[mine])}"


def test_spirl_is_made_of_its_group_packages():
    entries = {p.name for p in (ROOT / "spirl").iterdir() if p.suffix == ".py" or (p / "__init__.py").is_file()}
    grouped = set().union(*SPIRL_GROUPS.values())
    assert entries - {"__init__.py"} <= grouped, (
        f"spirl/ holds only the group packages {sorted(grouped)}; move {sorted(entries - {'__init__.py'} - grouped)} into one")
    assert {p for p in grouped if (ROOT / "spirl" / p / "__init__.py").is_file()} == grouped
