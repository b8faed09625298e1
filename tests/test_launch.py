"""spirl_kernels/launch.py without a GPU: which calls go through the JIT, what the direct launch passes, and the key."""

from __future__ import annotations

import inspect

import pytest
import torch

from spirl_kernels import launch as launch_mod
from spirl_kernels.launch import cdiv, next_power_of_2


class FakeCompiled:
    def __init__(self, log):
        self.log = log

    def __getitem__(self, grid):
        return lambda *args: self.log.append(("direct", grid, args))


class FakeKernel:
    """Stands in for a JITFunction(x_ptr, n, eps, BLOCK: constexpr, TAIL: constexpr = 0)."""

    def __init__(self):
        self.log = []
        sig = inspect.signature(lambda x_ptr, n, eps, BLOCK, TAIL=0: None)
        self.params = [type("P", (), {"name": p.name, "default": p.default})() for p in sig.parameters.values()]

    def __getitem__(self, grid):
        def jit(*args, **kwargs):
            self.log.append(("jit", grid, args, kwargs))
            return FakeCompiled(self.log)
        return jit


@pytest.fixture
def fast(monkeypatch):
    monkeypatch.setattr(launch_mod, "_FAST", True)
    monkeypatch.setattr(launch_mod, "_COMPILED", {})
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


def test_first_call_compiles_through_the_jit_then_launches_directly_in_signature_order(fast):
    k = FakeKernel()
    x = torch.zeros(8)
    launch_mod.launch(k, (3, 1, 1), (x, 64, 1e-6), {"BLOCK": 128}, num_warps=4)
    launch_mod.launch(k, (5, 1, 1), (x, 64, 1e-6), {"BLOCK": 128}, num_warps=4)
    assert k.log[0] == ("jit", (3, 1, 1), (x, 64, 1e-6), {"BLOCK": 128, "num_warps": 4})
    assert k.log[1] == ("direct", (5, 1, 1), (x, 64, 1e-6, 128, 0))  # constexprs after, TAIL's default filled in


@pytest.mark.parametrize("change", ["n", "n_aligned", "block", "warps", "eps", "dtype", "misaligned"])
def test_a_new_argument_value_or_specialization_takes_the_jit_again(fast, change):
    k = FakeKernel()
    x = torch.zeros(64)
    base = dict(args=(x, 64, 1e-6), constexprs={"BLOCK": 128}, options={"num_warps": 4})
    launch_mod.launch(k, (1, 1, 1), base["args"], base["constexprs"], **base["options"])
    other = {"n": dict(base, args=(x, 65, 1e-6)), "n_aligned": dict(base, args=(x, 48, 1e-6)),
             "block": dict(base, constexprs={"BLOCK": 64}), "warps": dict(base, options={"num_warps": 8}),
             "eps": dict(base, args=(x, 64, 1e-5)), "dtype": dict(base, args=(x.half(), 64, 1e-6)),
             "misaligned": dict(base, args=(x[1:], 64, 1e-6))}[change]
    launch_mod.launch(k, (1, 1, 1), other["args"], other["constexprs"], **other["options"])
    assert [e[0] for e in k.log] == ["jit", "jit"]
    launch_mod.launch(k, (1, 1, 1), (torch.ones(64), 64, 1e-6), base["constexprs"], **base["options"])
    assert k.log[-1][0] == "direct"  # another tensor of the same dtype and alignment: no new compile


def test_other_tritons_always_take_the_jit(monkeypatch):
    monkeypatch.setattr(launch_mod, "_FAST", False)
    k = FakeKernel()
    for _ in range(2):
        launch_mod.launch(k, (1, 1, 1), (torch.zeros(4), 4, 0.0), {"BLOCK": 4})
    assert [e[0] for e in k.log] == ["jit", "jit"]


def test_host_integer_helpers_match_tritons():
    import triton

    for a in range(0, 300):
        assert next_power_of_2(a) == triton.next_power_of_2(a)
        for b in (1, 7, 16, 128):
            assert cdiv(a, b) == triton.cdiv(a, b)
