"""vLLM 0.26.0 offline engine in batch-invariant mode, in this process, taking and returning token ids.

Settings and why:
* `VLLM_BATCH_INVARIANT=1` (must be set by the user before Python starts, since vllm reads it at
  import): batch-invariant kernels, so a sequence's numbers do not depend on its batch.
* in-process engine (`VLLM_ENABLE_V1_MULTIPROCESSING=0`): the model object is reachable, so new
  weights are copied in memory (no safetensors save + reload) and forward hooks can be attached.
* `spirl.numerics.vllm_patches.apply()` before the engine is built (see that module for why).
* CUDA graphs without torch.compile (`CUDA_GRAPH_MODES`; default `full`): every op
  still runs the same kernel as in eager mode, so a row's bits cannot change (a graph replays the
  recorded kernels; padding rows of a graph batch are separate rows of row-wise kernels).
  Inductor is never used: it fuses ops into kernels the trainer does not run. `none` = eager.
  See docs/vllm-0.26-forward-path.md.
* prefix caching off (a cached prefix is prefilled in a different split), bf16, a fixed seed.
* `logprobs=0`; `logprobs_mode` `processed_logprobs` (the logprob under the distribution that
  sampled: after temperature) or `raw_logprobs` (of the raw logits, independent of temperature).
"""

from __future__ import annotations

import gc
import logging
import os
import time
from dataclasses import dataclass
from typing import Iterable

import torch

from ..numerics import vllm_patches
from ..numerics.samples import Sample
from .base import Request

log = logging.getLogger(__name__)


VLLM_DEFAULT_MAX_GRAPH_TOKENS = 512
"""The largest capture size of vLLM 0.26's own list (`graph_sizes(512)`)."""

GRAPH_MAX_TOKENS = 2048
"""The largest engine step (tokens) that `graph_sizes()` captures by default; see `VLLMEngineConfig.cuda_graph_sizes`."""


def graph_sizes(max_tokens: int = GRAPH_MAX_TOKENS) -> tuple[int, ...]:
    """CUDA-graph step sizes: 1, 2, 4, multiples of 8 to 256 and of 16 to 512 (vLLM 0.26's own list for an
    H100, `VllmConfig._set_cudagraph_sizes`), then multiples of 256 up to `max_tokens`."""
    if max_tokens < 1:
        raise ValueError(f"graph_sizes: max_tokens must be at least 1, got {max_tokens}")
    top = VLLM_DEFAULT_MAX_GRAPH_TOKENS
    sizes = (1, 2, 4, *range(8, 256, 8), *range(256, top + 1, 16), *range(top + 256, max_tokens + 1, 256))
    return tuple(n for n in sizes if n <= max_tokens)


@dataclass
class VLLMEngineConfig:
    model_dir: str
    """Hugging Face checkpoint directory (config.json + safetensors) vLLM loads first."""
    seed: int = 0
    """Engine seed; each generate() call also takes its own sampling seed."""
    gpu_memory_utilization: float = 0.35
    """Fraction of GPU memory vLLM may take (the trainer shares the GPU)."""
    max_model_len: int = 4096
    """Longest prompt + completion, in tokens."""
    require_batch_invariant: bool = True
    """Refuse to start without VLLM_BATCH_INVARIANT=1. Only the check-has-teeth test turns this off."""
    cuda_graphs: str = "full"
    """One of CUDA_GRAPH_MODES: `full` (graphs for every step of at most the largest capture size's tokens,
    prefills included), `full_decode_only` (pure-decode steps only), `none` (eager). `full` since issue 39:
    an eager step costs ~20 ms of kernel launches whatever its size (H100, Qwen3-1.7B, 16-token prompts:
    batch 1 prefill 24 ms eager against 4.3 ms graphed, plain vLLM's 6.5 ms), which made short rollouts
    1.1-1.2x plain vLLM's; the same bits either way (tests/gpu/test_parity.py)."""
    cuda_graph_sizes: tuple[int, ...] | None = graph_sizes()
    """Step sizes, in tokens, that vLLM captures a CUDA graph for (its `cudagraph_capture_sizes`); a step
    replays the graph of the next size up, padded, and steps above the largest run eagerly. None: vLLM
    0.26's own list, which ends at 512. The default adds 768 to 2,048 in steps of 256 (issue 39): an eager
    step costs ~20 ms of kernel launches, so at Qwen3-1.7B, 64 new tokens, a rollout of 2 prompts of 512
    tokens took 0.218 s with vLLM's list and 0.182 s with this one (plain vLLM 0.181 s), and at Qwen3-8B 2 x 700
    0.521 s against 0.486 s (plain 0.487 s; H100, 2026-11-26). The graphs took 0.23 GiB (1.7B) and 0.34 GiB
    (8B) beyond vLLM's memory share, inside the memory plan's fixed overhead. With `max_num_seqs` set, only the
    sizes up to twice it are captured, and sizes above 512 only up to `max_model_len` (`compilation_kwargs`:
    vLLM 0.26 crashes capturing them at a small max_model_len). Padding rows are separate rows of row-wise
    kernels: no sequence's bits depend on it."""
    logprobs_mode: str = "raw_logprobs"
    """vLLM's logprobs_mode: `raw_logprobs` or `processed_logprobs` (after temperature / min-p)."""
    sleep_between_rollouts: bool = False
    """Build with vLLM's sleep mode, so `sleep()` can free the KV cache and move the weights to
    host memory while the trainer trains, and `wake_up()` bring them back."""
    load_format: str = "auto"
    """vLLM's load_format: `auto` reads model_dir's safetensors; `dummy` starts from placeholder
    weights (LoRA: the trainer loads the base in memory, so the checkpoint is read once)."""
    untie_lm_head: bool = False
    """Give lm_head a tensor of its own although config.json ties it to the embedding (LoRA on
    lm_head: the output projection is merged with the adapter, the input embedding is not); the
    caller loads `lm_head.weight`, so use it with load_format `dummy`."""
    external_launcher: bool = False
    """Under torchrun: one engine per rank (tensor parallel 1) on that rank's GPU, sharing the
    trainer's process group (vLLM's `external_launcher` backend; every rank generates its own
    prompts). Tensor-parallel engines for models larger than one GPU would set
    tensor_parallel_size > 1 here: vLLM then groups consecutive ranks into one engine."""
    max_num_seqs: int | None = None
    """Most sequences in one engine step (vLLM's max_num_seqs; None: vLLM 0.26.0's default for
    `vllm.LLM`, 1024 on a GPU of 70 GiB or more that is not an A100, such as an H100, else 256). vLLM
    captures decode CUDA graphs only up to twice this many sequences (at most 512: 51 sizes on an H100
    by default) and JIT-compiles the kernels of those sizes at start-up, so a job that generates a
    handful of sequences (run_comparison.sh) starts faster with it set to that count. Batch-invariant
    mode: no effect on any sequence's bits."""
    model_args: object = None
    """The checkpoint's torchtitan model args when the caller has read and checked its config.json
    already (spirl.core.policy.build_engine passes its ModelDir's): the engine's own check uses them
    instead of reading the file again (vLLM itself still reads config.json)."""


VLLM_LOGPROBS_MODE = {"sampling": "processed_logprobs", "raw": "raw_logprobs"}
"""vLLM's logprobs_mode for each `--logprobs` mode (spirl.numerics.parity.logprob_dist names the distribution)."""

CUDA_GRAPH_MODES = {
    # Graphs only for steps where every sequence decodes one token; prefills run eagerly.
    "full_decode_only": dict(compilation_config={"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}),
    # Graphs also for mixed prefill/decode steps up to the largest capture size.
    "full": dict(compilation_config={"mode": 0, "cudagraph_mode": "FULL"}),
    # Dynamo-split piecewise graphs, compiled with the eager backend (no Inductor) and vLLM's
    # custom CUDA ops kept ("all"), so no op changes kernel.
    "piecewise": dict(compilation_config={"mode": 3, "backend": "eager", "custom_ops": ["all"],
                                          "cudagraph_mode": "PIECEWISE"}),
    "none": dict(enforce_eager=True),
}


def compilation_kwargs(cuda_graphs: str, sizes: tuple[int, ...] | None, max_num_seqs: int | None = None,
                       max_model_len: int | None = None) -> dict:
    """vllm.LLM's keyword arguments for a CUDA_GRAPH_MODES mode and capture sizes (None: vLLM's). With
    `max_num_seqs` set, only the sizes up to twice it, as vLLM caps its own list (a job of a handful of
    sequences, such as run_comparison.sh, then captures a handful of graphs and starts faster).

    With `max_model_len` set, sizes above vLLM's own largest (512) only up to max_model_len: vLLM 0.26 hits
    an illegal memory access while capturing FULL graphs of 768-2,048 tokens when max_model_len is small,
    in its own batch-invariant mode as in ours (H100, random Qwen3-0.6B, 2026-11-27: max_model_len 96 and
    256 crashed with sizes to 2,048, 1,024 and 2,048 did not; 96 with sizes to 512, or to 96, did not). A step
    larger than the largest graph runs eagerly, so this costs only the graphs of prefills longer than
    max_model_len tokens."""
    if cuda_graphs not in CUDA_GRAPH_MODES:
        raise ValueError(f"cuda_graphs must be one of {', '.join(CUDA_GRAPH_MODES)}, got {cuda_graphs!r}")
    kwargs = dict(CUDA_GRAPH_MODES[cuda_graphs])
    if sizes is not None and max_num_seqs:
        sizes = tuple(n for n in sizes if n <= 2 * max_num_seqs) or (1,)
    if sizes is not None and max_model_len:
        sizes = tuple(n for n in sizes if n <= max(VLLM_DEFAULT_MAX_GRAPH_TOKENS, max_model_len)) or (1,)
    if sizes is not None and "compilation_config" in kwargs:
        kwargs["compilation_config"] = {**kwargs["compilation_config"], "cudagraph_capture_sizes": sorted(sizes)}
    return kwargs


SUPPORTED_HEAD_DIMS = (128,)
"""Head dims whose attention vLLM 0.26 computes alike in prefill, in decode and in the trainer.

vLLM's FlashAttention-3 (vllm-project/flash-attention caaa4eb5, hopper/tile_size.h) sums keys in
blocks of kBlockN, and kBlockN is 128 for causal head_dim 128 on every path. For head_dim <= 64 a
pure-decode step (max_seqlen_q = 1) drops the causal flag and gets kBlockN 192 (or 160), while a
prefill gets 128: the same row then has other bits in decode than in prefill (measured on an H200
at head_dim 64). Head dims 80-96 get 144 without a page table (the trainer) and 128 with one
(vLLM). Every released Qwen3 has head_dim 128."""


def check_model_supported(model_dir: str, model_args=None) -> None:
    """Refuse, in one line, a checkpoint whose rollouts vLLM 0.26 cannot make self-consistent
    (`model_args`: its model args, if its config.json was read already)."""
    from torchtitan_compat.config import ConfigError, ModelDir

    head_dim = (model_args or ModelDir.read(model_dir).args).head_dim
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ConfigError(
            f"{model_dir}: head_dim {head_dim} is not supported with vLLM 0.26 (its FlashAttention-3 sums "
            f"attention in other blocks when decoding than when prefilling at this head_dim, so rollout "
            f"logprobs would not match any forward); use a checkpoint with head_dim 128, or --engine native")


def prepare_environment(require_batch_invariant: bool = True) -> None:
    """Check/set the environment vLLM reads at import time; raise if it is too late to fix."""
    if require_batch_invariant and os.environ.get("VLLM_BATCH_INVARIANT") != "1":
        raise RuntimeError("VLLM_BATCH_INVARIANT=1 is not set: start with "
                           "`VLLM_BATCH_INVARIANT=1 python ...` (vLLM reads it at import)")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")


def process_wide_settings(require_batch_invariant: bool = True) -> None:
    """What building a VLLMEngine sets for its whole process, without building one: the environment, SPIRL's
    vLLM patches, and vLLM's batch-invariant mode (its aten overrides of softmax, log_softmax, mean and bmm, cuBLAS
    without split-k or reduced-precision reductions, TF32 off: `init_batch_invariance`, which vLLM's worker calls
    when it starts). A trainer whose engine runs in a process of its own (--generation-gpus) calls it where a
    colocated engine would be built, so that its own ops compute as a colocated trainer's do: without it, the
    update of step 1 differed from the colocated run's (weight change 7e-8 relative, same samples, two H200s)."""
    prepare_environment(require_batch_invariant)
    vllm_patches.apply()
    from vllm.model_executor.layers.batch_invariant import init_batch_invariance

    init_batch_invariance()


class VLLMEngine:
    seeds_children: bool = True
    """vLLM runs a request of n samples and seed s as n requests of one sample and seeds s, s+1, ...
    (vllm/v1/engine/parallel_sampling.py, 0.26.0), each sampled as it would be alone (batch
    invariance): so consecutive one-sample requests of one prompt and seeds s, s+1, ... may be sent
    as one request of n, for the same bits (tests/gpu/test_tinker_gpu.py checks it)."""
    samples_beside_training: bool = True
    """--off-policy-steps may run generate() on a thread of its own while the trainer computes:
    the engine's kernels read only its own tensors (and, with LoRA, the base weights no optimizer step changes
    before the rollout is finished), and each is batch invariant, so what runs beside it cannot change its bits."""

    def __init__(self, cfg: VLLMEngineConfig):
        from torchtitan_compat.config import ModelDir, is_moe

        prepare_environment(cfg.require_batch_invariant)
        args = cfg.model_args or ModelDir.read(cfg.model_dir).args  # config.json read once
        check_model_supported(cfg.model_dir, args)
        self.moe = is_moe(args)
        """Qwen3-MoE: vLLM runs it on its V1 model runner, asked to return every token's experts."""
        vllm_patches.apply()
        from vllm import LLM

        t0 = time.perf_counter()
        self.cfg = cfg
        graphs = compilation_kwargs(cfg.cuda_graphs, cfg.cuda_graph_sizes, cfg.max_num_seqs, cfg.max_model_len)
        self.llm = LLM(model=cfg.model_dir, skip_tokenizer_init=True, dtype="bfloat16", seed=cfg.seed,
                       enable_prefix_caching=False, gpu_memory_utilization=cfg.gpu_memory_utilization,
                       max_model_len=cfg.max_model_len, logprobs_mode=cfg.logprobs_mode,
                       enable_sleep_mode=cfg.sleep_between_rollouts, **graphs,
                       load_format=cfg.load_format,
                       **({"max_num_seqs": cfg.max_num_seqs} if cfg.max_num_seqs else {}),
                       hf_overrides={"tie_word_embeddings": False} if cfg.untie_lm_head else None,
                       **({"enable_return_routed_experts": True} if self.moe else {}),
                       **({"distributed_executor_backend": "external_launcher"} if cfg.external_launcher else {}))
        self.asleep = False
        self.start_seconds = time.perf_counter() - t0
        sizes = self.llm.llm_engine.vllm_config.compilation_config.cudagraph_capture_sizes or []
        from spirl_kernels import gemm_cublas

        gemms = gemm_cublas.checked()
        log.info("vLLM engine ready in %.1fs (%s, cuda graphs: %s, %d sizes up to %s tokens; GEMM products on cuBLAS "
                 "so far: %d, on the Triton kernel for other cuBLAS bits: %d, timed faster there: %d)",
                 self.start_seconds, cfg.model_dir, cfg.cuda_graphs, len(sizes), max(sizes, default=0),
                 gemms["cublas"], gemms["other_bits"], gemms["triton_faster"])

    @property
    def model(self) -> torch.nn.Module:
        """vLLM's Qwen3ForCausalLM (V2 model runner) or Qwen3MoeForCausalLM (V1) instance, in-process."""
        return self.llm.llm_engine.model_executor.driver_worker.worker.model_runner.model

    def prefill_budget(self) -> tuple[int, int]:
        """(tokens, sequences) one engine step may schedule: vLLM's max_num_batched_tokens and max_num_seqs
        (spirl.loops.precompile sends prefills up to these, each in one step)."""
        sched = self.llm.llm_engine.vllm_config.scheduler_config
        return int(sched.max_num_batched_tokens), int(sched.max_num_seqs)

    def compat_weights(self, model_args) -> dict[str, torch.Tensor]:
        """The engine's own weight tensors under the trainer's names (weights_vllm_compat's merged
        layout; vLLM's Qwen3 fuses qkv_proj and gate_up_proj the same way): views, not copies, so
        writing into one changes what the next rollout computes (CUDA graphs replay the same
        addresses). `output.weight` is there when lm_head has its own tensor. Shapes are checked
        against the layout, so a vLLM that laid its weights out otherwise fails here, in one line."""
        from weights_vllm_compat import expected_compat_shapes

        from torchtitan_compat.vllm_ops import PINNED_VLLM_VERSION

        top = self.model
        m, v = top.model, model_args.vocab_size
        out = {"tok_embeddings.weight": m.embed_tokens.weight.data[:v]}
        for i, layer in enumerate(m.layers):
            p, attn, mlp = f"layers.{i}.", layer.self_attn, layer.mlp
            out.update({
                p + "attention_norm.weight": layer.input_layernorm.weight.data,
                p + "attention.qkv_proj.weight": attn.qkv_proj.weight.data,
                p + "attention.o_proj.weight": attn.o_proj.weight.data,
                p + "attention.q_norm.weight": attn.q_norm.weight.data,
                p + "attention.k_norm.weight": attn.k_norm.weight.data,
                p + "ffn_norm.weight": layer.post_attention_layernorm.weight.data,
            })
            if hasattr(mlp, "gate_up_proj"):
                out.update({p + "feed_forward.gate_up_proj.weight": mlp.gate_up_proj.weight.data,
                            p + "feed_forward.down_proj.weight": mlp.down_proj.weight.data})
            else:  # Qwen3-MoE sparse block: FusedMoE's w13 [E, 2I, D] and w2 [E, D, I] are the trainer's layout
                params = {k.rsplit(".", 1)[-1]: v.data for k, v in mlp.named_parameters()}
                out.update({p + "moe.router.weight": mlp.gate.weight.data,
                            p + "moe.experts.gate_up_proj": params.get("w13_weight"),
                            p + "moe.experts.down_proj": params.get("w2_weight")})
        out["norm.weight"] = m.norm.weight.data
        if top.lm_head is not m.embed_tokens:
            out["output.weight"] = top.lm_head.weight.data[:v]
        expected = expected_compat_shapes(model_args)
        expected.setdefault("output.weight", (v, model_args.dim))
        wrong = [k for k, t in out.items() if t is None or tuple(t.shape) != tuple(expected[k])]
        if wrong or len(m.layers) != model_args.n_layers:
            k = wrong[0] if wrong else "layers"
            raise RuntimeError(f"vLLM's Qwen3 weights are not laid out as the trainer's ({k}: "
                               f"{list(getattr(out[k], 'shape', [])) if wrong else len(m.layers)}); vLLM "
                               f"{PINNED_VLLM_VERSION} is required")
        return out

    def generate(self, prompts: list[list[int]], n: int = 1, max_tokens: int = 64,
                 temperature: float = 1.0, seed: int | list[int] | None = None,
                 min_p: float = 0.0, top_k: int = -1, top_p: float = 1.0) -> list[Sample]:
        """n samples per prompt, prompt-major. `seed`: one sampling seed for the call, or one per
        prompt (multi-turn rollouts give each episode's turn its own)."""
        seeds = seed if isinstance(seed, list) else [seed] * len(prompts)
        if len(seeds) != len(prompts):
            raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts")
        requests = [Request(list(p), n=n, max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                            seed=s, min_p=min_p) for p, s in zip(prompts, seeds)]
        return [smp for group in self.sample(requests) for smp in group]

    def sample(self, requests: list[Request]) -> list[list[Sample]]:
        """Each request's n samples (its own settings), all in one engine call; logprobs as the
        engine's logprobs_mode says. Token ids only (detokenize=False): nothing downstream reads
        vLLM's text, and its incremental detokenizer is per-request Python on every decode step."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self.wake_up()
        params = [SamplingParams(n=r.n, max_tokens=r.max_tokens, temperature=r.temperature, logprobs=0, seed=r.seed,
                                 min_p=r.min_p, top_k=r.top_k, top_p=r.top_p, stop_token_ids=list(r.stop_token_ids),
                                 ignore_eos=r.ignore_eos, detokenize=False) for r in requests]
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(r.prompt)) for r in requests], params,
                                    use_tqdm=False)
        return [[_to_sample(list(r.prompt), c) for c in out.outputs] for r, out in zip(requests, outputs)]

    def greedy(self, prompts: list[list[int]], max_tokens: int = 64) -> list[list[int]]:
        """The argmax completion of each prompt (evaluation; temperature 0, no logprobs)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self.wake_up()
        params = SamplingParams(n=1, max_tokens=max_tokens, temperature=0.0, detokenize=False)
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params,
                                    use_tqdm=False)
        return [list(out.outputs[0].token_ids) for out in outputs]

    def sleep(self) -> None:
        """Free the KV cache and move the weights to host memory (vLLM sleep level 1), if the
        engine was built for it; the next generate() or load_weights() wakes it up."""
        if self.cfg.sleep_between_rollouts and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True

    def wake_up(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    def load_weights(self, hf_named_tensors: Iterable[tuple[str, torch.Tensor]]) -> float:
        """Copy new weights (Hugging Face names, any device) into the engine in memory; seconds taken."""
        t0 = time.perf_counter()
        self.wake_up()
        self.model.load_weights(hf_named_tensors)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    def load_all_weights(self, hf_named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """load_weights, then check that every parameter of the engine was written (vLLM checks
        nothing after `load_format="dummy"`: a missing tensor would keep its placeholder values)."""
        self.wake_up()
        loaded = self.model.load_weights(hf_named_tensors)
        torch.cuda.synchronize()
        loaded = set(loaded or ())
        # vLLM 0.26's FusedMoE loader reports `...mlp.experts.w13_weight` for the parameter it names
        # `...mlp.experts.routed_experts.w13_weight`
        missing = sorted(n for n, _ in self.model.named_parameters()
                         if n not in loaded and n.replace(".routed_experts.", ".") not in loaded)
        if missing:
            raise RuntimeError(f"vLLM kept placeholder values for {len(missing)} weight(s), e.g. {missing[0]}: "
                               "the weights given do not cover the model")

    def close(self) -> None:
        """Shut the engine down (idempotent): its engine core frees the model and KV cache and ends
        the torch.distributed world vLLM started in this process, so the process exits without
        torch's "destroy_process_group() was not called" warning. vLLM's in-process LLM has no
        shutdown of its own and runs none at exit."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is None:
            return
        core = getattr(llm.llm_engine, "engine_core", None)
        if core is not None:
            core.shutdown()
        del llm
        gc.collect()


def _to_sample(prompt_ids: list[int], completion) -> Sample:
    ids = list(completion.token_ids)
    if completion.logprobs is None or len(completion.logprobs) != len(ids):
        raise RuntimeError("vLLM returned no logprob for some sampled token (logprobs=0 expected)")
    # vLLM reports float32 values as Python floats: converting back to float32 is exact.
    lps = torch.tensor([step[tok].logprob for step, tok in zip(completion.logprobs, ids)],
                       dtype=torch.float32)
    routes = getattr(completion, "routed_experts", None)  # Qwen3-MoE: uint8 [prompt + sampled - 1, layers, k]
    return Sample(prompt_ids, ids, lps, completion.finish_reason,
                  None if routes is None else torch.from_numpy(routes.copy()))
