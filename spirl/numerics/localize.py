"""Where do vLLM's Qwen3 and our trainer model first disagree? Layer-by-layer, op-by-op.

When final logprobs differ bitwise, this captures the intermediate activations of both models
for the same tokens and reports the FIRST op (in forward order) whose output is not bit-identical,
plus the max |Δ| per layer, so that the cause can be looked for in one kernel instead of 28 layers.

Canonical names (the forward order; both captures use them):

    embed
    layers.{i}.{op} for op in LAYER_OPS, layer by layer
    final_norm
    logits

Usage (on a GPU machine, vLLM running in-process: `VLLM_ENABLE_V1_MULTIPROCESSING=0`,
no CUDA graph replay, `vllm_patches.eager_steps`, so that module hooks fire; one prompt)::

    with eager_steps(llm):
        theirs = capture_vllm(vllm_model, lambda: llm.generate([prompt], SamplingParams(max_tokens=1)))
    ours = capture_ours(model, p.tokens, p.positions, p.cu_seqlens)
    print(localize(ours, theirs).format())

Every captured tensor is detached, copied to the CPU at hook time and keeps its dtype (bf16), so
that the comparison is bit-for-bit. Copying at hook time matters: vLLM's fused norms and rotary
overwrite their inputs in place later in the forward.

Logits: vLLM only computes logits for the rows it samples from (the last token of the prompt in
a prefill), ours are computed for every token. `localize` compares the LAST rows both have.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
from torch import nn

from spirl.numerics.vllm_patches import eager_steps, qk_through_vllms_modules

LAYER_OPS = (
    "input_norm", "qkv_proj", "q_norm", "k_norm", "rotary_q", "rotary_k", "attn", "o_proj",
    "post_attn_norm", "gate_up_proj", "act", "down_proj",
)
"""Ops of one decoder layer, in the order the forward runs them."""

_LAYER_NAME = re.compile(r"^layers\.(\d+)\.(\w+)$")

# Where each op's output is read, per model: (submodule path inside the layer, op, hook kind).
# "out" = the module's forward output; "in" = its first positional input (forward pre-hook),
# used where the value we want is computed functionally, not by a module of its own.
_OUR_LAYER_HOOKS = (
    ("attention_norm", "input_norm", "out"),
    ("attention.qkv_proj", "qkv_proj", "out"),
    ("attention.o_proj", "attn", "in"),  # attention output, [T, H*D], as o_proj receives it
    ("attention.o_proj", "o_proj", "out"),
    ("ffn_norm", "post_attn_norm", "out"),
    ("feed_forward.gate_up_proj", "gate_up_proj", "out"),
    ("feed_forward.down_proj", "act", "in"),  # silu_and_mul output, as down_proj receives it
    ("feed_forward.down_proj", "down_proj", "out"),
)

_VLLM_LAYER_HOOKS = (
    ("input_layernorm", "input_norm", "out"),
    ("self_attn.qkv_proj", "qkv_proj", "out"),
    ("self_attn.q_norm", "q_norm", "out"),
    ("self_attn.k_norm", "k_norm", "out"),
    ("self_attn.attn", "attn", "out"),
    ("self_attn.o_proj", "o_proj", "out"),
    ("post_attention_layernorm", "post_attn_norm", "out"),
    ("mlp.gate_up_proj", "gate_up_proj", "out"),
    ("mlp.act_fn", "act", "out"),
    ("mlp.down_proj", "down_proj", "out"),
)
_VLLM_TOP_HOOKS = (
    ("model.embed_tokens", "embed"),
    ("model.norm", "final_norm"),
    ("logits_processor", "logits"),
)


def canonical_names(n_layers: int) -> list[str]:
    """All names in forward order for a model of `n_layers` decoder layers."""
    names = ["embed"]
    for i in range(n_layers):
        names += [f"layers.{i}.{op}" for op in LAYER_OPS]
    return names + ["final_norm", "logits"]


# --------------------------------------------------------------------------------------------
# Capture helpers
# --------------------------------------------------------------------------------------------


def _snapshot(t: torch.Tensor) -> torch.Tensor:
    """A CPU copy taken now (stream-ordered on CUDA), same dtype, detached from autograd."""
    return t.detach().to("cpu", copy=True)


def _primary(output):
    """The activation in a module's output: vLLM's linears return (out, None) and its fused
    norms return (normed, residual); plain modules return the tensor itself."""
    return output[0] if isinstance(output, (tuple, list)) else output


class _Store:
    """Captured tensors by canonical name. Keeps the FIRST value per name: if the capture window
    runs more than one forward (e.g. a decode step after the prefill), later ones are counted,
    not stored, so the prefill of interest is never overwritten."""

    def __init__(self):
        self.tensors: dict[str, torch.Tensor] = {}
        self.repeats: dict[str, int] = {}

    def put(self, name: str, t: torch.Tensor) -> None:
        if name in self.tensors:
            self.repeats[name] = self.repeats.get(name, 0) + 1
        else:
            self.tensors[name] = _snapshot(t)


def _register(store: _Store, module: nn.Module, name: str, kind: str) -> torch.utils.hooks.RemovableHandle:
    """Hook `module` so that its output ("out") or first positional input ("in") lands in `store`."""
    if kind == "in":
        return module.register_forward_pre_hook(lambda _m, args: store.put(name, args[0]))
    return module.register_forward_hook(lambda _m, _args, out: store.put(name, _primary(out)))


# --------------------------------------------------------------------------------------------
# Our model
# --------------------------------------------------------------------------------------------


class _RecordingBackend:
    """Stands in for the model's kernel backend and records q_norm, k_norm and rotary outputs.

    Our model runs Qwen3's q/k RMSNorm and RoPE as one functional op (`bib.qk_norm_rope(...,
    p.backend)`), so no module hook can see them; the backend object is the one seam. The op's
    outputs are recorded as `rotary_q/k`; `q_norm/k_norm` are recorded from the backend's own
    RMSNorm of the same inputs (the op is proven equal to RMSNorm then rotary, bit for bit, so a
    difference that shows first at `rotary_*` is in the fused step). Everything is delegated
    unchanged, so the forward computes exactly what it would without the proxy. The model calls
    the op once per layer, in layer order, which is how a call is mapped to its layer.
    """

    def __init__(self, inner, store: _Store):
        self._inner, self._store, self._calls = inner, store, 0

    def __getattr__(self, attr):
        return getattr(self._inner, attr)

    def qk_norm_rope(self, positions, q, k, q_weight, k_weight, eps, cos_sin_cache):
        layer = f"layers.{self._calls}"
        self._store.put(f"{layer}.q_norm", self._inner.rms_norm(q, q_weight, eps))
        self._store.put(f"{layer}.k_norm", self._inner.rms_norm(k, k_weight, eps))
        q_rot, k_rot = self._inner.qk_norm_rope(positions, q, k, q_weight, k_weight, eps, cos_sin_cache)
        self._store.put(f"{layer}.rotary_q", q_rot)
        self._store.put(f"{layer}.rotary_k", k_rot)
        self._calls += 1
        return q_rot, k_rot


def capture_ours(model: nn.Module, tokens: torch.Tensor, positions: torch.Tensor,
                 cu_seqlens: torch.Tensor, max_seqlen: int | None = None) -> dict[str, torch.Tensor]:
    """Run one no-grad forward of our `Qwen3VLLMCompatModel` and return every canonical activation.

    Shapes: [T, ·] per token, except q_norm/k_norm/rotary_* which are [T, H, D]; logits [T, V].
    The model is left as it was (hooks removed, original backend restored), even on error.
    """
    store = _Store()
    handles = [_register(store, model.tok_embeddings, "embed", "out"),
               _register(store, model.norm, "final_norm", "out")]
    for i, layer in enumerate(model.layers):
        for path, op, kind in _OUR_LAYER_HOOKS:
            handles.append(_register(store, layer.get_submodule(path), f"layers.{i}.{op}", kind))
    recorder = _RecordingBackend(model.backend, store)
    original_backend, model.backend = model.backend, recorder
    try:
        with torch.no_grad():
            logits = model(tokens, positions, cu_seqlens, max_seqlen)
    finally:
        model.backend = original_backend
        for h in handles:
            h.remove()
    store.put("logits", logits)
    if recorder._calls != len(model.layers):
        raise RuntimeError(f"qk_norm_rope ran {recorder._calls} times for {len(model.layers)} layers")
    return store.tensors


# --------------------------------------------------------------------------------------------
# vLLM's model
# --------------------------------------------------------------------------------------------


def _register_vllm_rotary(store: _Store, layers) -> list:
    """Hook the layers' `self_attn.rotary_emb`, which vLLM shares across layers (one module,
    called once per layer in order). Layers are grouped by module; the k-th call of a module is
    the k-th layer of its group, so this also works if each layer had a module of its own.

    vLLM's output is (q, k) flat [T, H*D], rotated in place; reshaped to [T, H, D] like ours,
    D being the attention's `head_dim` (or the last dim of that layer's q_norm capture)."""
    groups: dict[int, tuple[nn.Module, list[int]]] = {}
    for i, layer in enumerate(layers):
        rope = layer.self_attn.rotary_emb
        groups.setdefault(id(rope), (rope, []))[1].append(i)

    def head_dim(i: int) -> int | None:
        d = getattr(layers[i].self_attn, "head_dim", None)
        q_norm = store.tensors.get(f"layers.{i}.q_norm")
        return d if d is not None else (q_norm.shape[-1] if q_norm is not None else None)

    def make_hook(layer_ids: list[int]):
        calls = [0]

        def hook(_m, _args, out):
            # Calls past the group's length belong to a later forward: wrapping around makes
            # store.put() count them as repeats instead of inventing layers.
            i = layer_ids[calls[0] % len(layer_ids)]
            calls[0] += 1
            q, k = out[0], out[1]
            d = head_dim(i)
            if d is not None:
                q, k = q.reshape(q.shape[0], -1, d), k.reshape(k.shape[0], -1, d)
            store.put(f"layers.{i}.rotary_q", q)
            store.put(f"layers.{i}.rotary_k", k)
        return hook

    return [rope.register_forward_hook(make_hook(ids)) for rope, ids in groups.values()]


def capture_vllm(vllm_model: nn.Module, run_fn: Callable[[], object]) -> dict[str, torch.Tensor]:
    """Hook vLLM's `Qwen3ForCausalLM` module tree, call `run_fn()`, return canonical activations.

    `vllm_model` is the in-process model module (e.g. from `llm.llm_engine.model_executor
    .driver_worker.worker.model_runner.model`, or via `llm.apply_model`). `run_fn` must make vLLM
    run exactly one prefill of exactly the tokens of interest, a single prompt (for instance
    `llm.generate([prompt], SamplingParams(max_tokens=1))`). If it runs more forwards, the first
    one is kept and a warning says so. Hooks only fire in eager mode (no CUDA graph replay: run it
    inside `vllm_patches.eager_steps`). Hooks are removed when this returns or raises.
    """
    store = _Store()
    layers = list(vllm_model.model.layers)
    handles = [_register(store, vllm_model.get_submodule(path), name, "out")
               for path, name in _VLLM_TOP_HOOKS]
    for i, layer in enumerate(layers):
        for path, op, kind in _VLLM_LAYER_HOOKS:
            handles.append(_register(store, layer.get_submodule(path), f"layers.{i}.{op}", kind))
    handles += _register_vllm_rotary(store, layers)
    try:
        with qk_through_vllms_modules(layers):  # hooks on q_norm/k_norm/rotary_emb must fire
            run_fn()
    finally:
        for h in handles:
            h.remove()
    if store.repeats:
        warnings.warn(f"run_fn ran more than one forward ({len(store.repeats)} names captured "
                      f"again, e.g. {next(iter(store.repeats))}); kept the first forward's values")
    return store.tensors


# --------------------------------------------------------------------------------------------
# Comparison
# --------------------------------------------------------------------------------------------

_INT_VIEW = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Bit patterns of a floating tensor as integers (so -0.0 != 0.0 and NaN == same NaN)."""
    if t.is_floating_point() and t.element_size() in _INT_VIEW:
        return t.contiguous().view(_INT_VIEW[t.element_size()])
    return t


@dataclass
class OpComparison:
    """One canonical tensor compared between our capture and vLLM's."""

    name: str
    shape: tuple[int, ...]  # the compared [rows, features] shape
    n_diff: int  # elements whose bit patterns differ
    max_abs_diff: float  # in float32
    first_diff_token: int | None  # first token row with a differing element (None if equal)
    note: str = ""

    @property
    def equal(self) -> bool:
        return self.n_diff == 0

    @property
    def group(self) -> str:
        """'embed', 'layer N' or 'head' (final norm and logits): the rows of the summary table."""
        m = _LAYER_NAME.match(self.name)
        if m:
            return f"layer {m.group(1)}"
        return "embed" if self.name == "embed" else "head"

    @property
    def op(self) -> str:
        m = _LAYER_NAME.match(self.name)
        return m.group(2) if m else self.name

    def describe(self) -> str:
        n = self.shape[0] * self.shape[1] if len(self.shape) == 2 else 0
        s = (f"{self.name} (max |Δ| {self.max_abs_diff:.4g}, first differing token "
             f"{self.first_diff_token}, {self.n_diff}/{n} elements differ)")
        return s + (f" [{self.note}]" if self.note else "")


@dataclass
class LocalizationReport:
    comparisons: list[OpComparison]  # in canonical order
    missing_in_ours: list[str] = field(default_factory=list)
    missing_in_theirs: list[str] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)  # shape problems: not compared

    @property
    def first_divergence(self) -> OpComparison | None:
        """The first op in forward order whose output is not bit-identical: where it starts."""
        return next((c for c in self.comparisons if not c.equal), None)

    def groups(self) -> Iterator[tuple[str, list[OpComparison]]]:
        """Comparisons grouped as embed, layer 0, layer 1, ..., head (keeps canonical order)."""
        out: dict[str, list[OpComparison]] = {}
        for c in self.comparisons:
            out.setdefault(c.group, []).append(c)
        return iter(out.items())

    def format(self) -> str:
        lines = [f"{'layer':<10} {'max |Δ|':>10}  ops differing"]
        for group, comps in self.groups():
            bad = [c.op for c in comps if not c.equal]
            worst = max(c.max_abs_diff for c in comps)
            lines.append(f"{group:<10} {worst:>10.4g}  {', '.join(bad) if bad else '-'}")
        for label, names in (("missing in ours", self.missing_in_ours),
                             ("missing in vLLM", self.missing_in_theirs)):
            if names:
                lines.append(f"{label}: {', '.join(names)}")
        lines += [f"not compared: {m}" for m in self.mismatches]
        first = self.first_divergence
        if first is None:
            lines.append(f"no divergence in {len(self.comparisons)} captured tensors")
        else:
            lines.append(f"first divergence: {first.describe()}")
        return "\n".join(lines)


def _order(ours: dict, theirs: dict) -> list[str]:
    """Canonical order for as many layers as either capture has, then any unknown names."""
    layer_ids = [int(m.group(1)) for n in (*ours, *theirs) if (m := _LAYER_NAME.match(n))]
    names = canonical_names(max(layer_ids, default=-1) + 1)
    known = set(names)
    extra = sorted({n for n in (*ours, *theirs) if n not in known})
    return names + extra


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    """[T, -1]: one row per token, whatever head layout the capture used."""
    return t.reshape(t.shape[0], -1) if t.dim() >= 1 else t.reshape(1, 1)


def _align_logits(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int, str]:
    """vLLM has logits only for the sampled (last) rows: compare the last rows both have.
    Returns both views, the token index of their first row, and a note."""
    n = min(a.shape[0], b.shape[0])
    offset = max(a.shape[0], b.shape[0]) - n
    note = "" if a.shape[0] == b.shape[0] else f"last {n} row(s) compared"
    return a[a.shape[0] - n:], b[b.shape[0] - n:], offset, note


def compare_tensors(name: str, a: torch.Tensor, b: torch.Tensor) -> OpComparison | str:
    """Compare two captures of one op; a string explains why they cannot be compared."""
    a, b = _as_rows(a), _as_rows(b)
    offset, note = 0, ""
    if name == "logits":
        a, b, offset, note = _align_logits(a, b)
    if a.shape != b.shape:
        return f"{name}: shape ours {tuple(a.shape)} vs vLLM {tuple(b.shape)} (as [tokens, features])"
    if a.dtype != b.dtype:
        # Bit patterns of different dtypes mean nothing; compare the values instead.
        note = ", ".join(filter(None, [note, f"dtype ours {a.dtype} vs vLLM {b.dtype}: compared by value"]))
        differs = a.float() != b.float()
    else:
        differs = _bits(a) != _bits(b)
    rows = differs.any(dim=1).nonzero()
    delta = (a.float() - b.float()).abs()
    return OpComparison(
        name=name, shape=tuple(a.shape), n_diff=int(differs.sum()),
        max_abs_diff=float(delta.max()) if delta.numel() else 0.0,
        first_diff_token=int(rows[0]) + offset if rows.numel() else None, note=note)


def localize(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> LocalizationReport:
    """Compare our capture with vLLM's name by name in forward order (see `LocalizationReport`)."""
    report = LocalizationReport(comparisons=[])
    for name in _order(ours, theirs):
        if name not in ours and name not in theirs:
            continue  # e.g. a model without an op we list; nothing to say
        if name not in ours:
            report.missing_in_ours.append(name)
        elif name not in theirs:
            report.missing_in_theirs.append(name)
        else:
            result = compare_tensors(name, ours[name].cpu(), theirs[name].cpu())
            if isinstance(result, str):
                report.mismatches.append(result)
            else:
                report.comparisons.append(result)
    return report


def localize_sample(harness, ids: list[int]) -> str:
    """Prefill `ids` in vLLM's engine and in the trainer under hooks; the formatted report.

    `harness` is a compare.harness.ParityHarness (in-process engine), or anything with the same `engine` (a
    spirl VLLMEngine) and `model`."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from torchtitan_compat import pack

    def prefill():
        harness.engine.llm.generate([TokensPrompt(prompt_token_ids=list(ids))],
                                    SamplingParams(max_tokens=1), use_tqdm=False)

    with eager_steps(harness.engine.llm):  # CUDA graphs would replay the prefill without calling the hooks
        theirs = capture_vllm(harness.engine.model, prefill)
    p = pack([ids], device="cuda")
    ours = capture_ours(harness.model, p.tokens, p.positions, p.cu_seqlens, p.max_seqlen)
    return localize(ours, theirs).format()
