"""One vLLM engine and one trainer model on the same checkpoint, compared token by token.

Used by `direct_forward.py` (one prompt, a table) and `parity_matrix.py` (many shapes of batch).
The trainer recomputes the sampled sequences in packed forwards of at most `max_packed_tokens`
tokens and its logprobs are compared with vLLM's by bit pattern.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from spirl.numerics.samples import Sample
from spirl.engines.vllm_engine import VLLM_LOGPROBS_MODE, VLLMEngineConfig
from spirl.numerics.parity import (RAW, ParityReport, SamplingDist, compare_logprobs, logprob_dist, routes_report,
                                   sampled_logprobs_and_routes)

log = logging.getLogger(__name__)

OPS = ("rms_norm", "silu_and_mul", "linear", "rotary", "attention", "token_logprobs")


@dataclass
class HarnessConfig:
    model_dir: str
    backend: str = "vllm"
    """Trainer kernel backend ('reference' = plain PyTorch: a check that must fail)."""
    swap_op: str | None = None
    """Replace this one op of the trainer's backend by the plain-PyTorch one (must fail)."""
    seed: int = 0
    gpu_memory_utilization: float = 0.35
    max_model_len: int = 4096
    max_packed_tokens: int = 16384
    allow_batch_variant: bool = False
    """Run even without VLLM_BATCH_INVARIANT=1 (only to show that the check then fails)."""
    cuda_graphs: str = VLLMEngineConfig.cuda_graphs
    """The engine's CUDA-graph mode (spirl.engines.vllm_engine.CUDA_GRAPH_MODES)."""
    max_num_seqs: int | None = None
    """Sequences per engine step (VLLMEngineConfig.max_num_seqs): direct_forward passes how many it
    generates, so the engine captures and compiles no larger batch sizes (start-up time only)."""
    logprobs: str = "sampling"
    """Which logprobs are compared: `sampling` (vLLM's processed_logprobs: logits / T, then min-p,
    and the trainer applies the same with vLLM's kernels) or `raw` (the raw logits')."""


class SwappedOpBackend:
    """The trainer backend with one op taken from the reference backend (to prove the check bites)."""

    def __init__(self, base, op: str):
        from torchtitan_compat.ops import ReferenceBackend

        if op not in OPS:
            raise ValueError(f"--swap-op must be one of {', '.join(OPS)}, got {op!r}")
        self._base, self._ref, self._op = base, ReferenceBackend(), op
        self.name = f"{base.name}+reference:{op}"

    def __getattr__(self, item):
        return getattr(self._ref if item == self._op else self._base, item)

    def qk_norm_rope(self, *args):
        """Qwen3's q/k step as RMSNorm then rotary of this backend, so that a swapped one shows."""
        from torchtitan_compat.backend_base import norm_then_rotary

        if self._op in ("rms_norm", "rotary"):
            return norm_then_rotary(self, *args)
        return self._base.qk_norm_rope(*args)


class ParityHarness:
    def __init__(self, cfg: HarnessConfig):
        from spirl.engines.vllm_engine import VLLMEngine
        from weights_vllm_compat import load_model

        self.cfg = cfg
        self.engine = VLLMEngine(VLLMEngineConfig(
            cfg.model_dir, cfg.seed, cfg.gpu_memory_utilization, cfg.max_model_len,
            require_batch_invariant=not cfg.allow_batch_variant, cuda_graphs=cfg.cuda_graphs,
            logprobs_mode=VLLM_LOGPROBS_MODE[cfg.logprobs], max_num_seqs=cfg.max_num_seqs))
        backend = cfg.backend
        if backend == "vllm":
            from torchtitan_compat.config import ModelDir
            from torchtitan_compat.vllm_ops import VLLMBackend, vllm_runner

            backend = VLLMBackend(require_batch_invariant=not cfg.allow_batch_variant,
                                  sampler=vllm_runner(ModelDir.read(cfg.model_dir).args))
        self.model = load_model(cfg.model_dir, device="cuda", dtype=torch.bfloat16,
                                backend=backend).eval()
        if cfg.swap_op:
            self.model.backend = SwappedOpBackend(self.model.backend, cfg.swap_op)
        log.info("trainer kernel backend: %s", self.model.backend.name)

    def close(self) -> None:
        """Shut the engine down (VLLMEngine.close): a clean process exit."""
        self.engine.close()

    def generate(self, prompts, n, max_tokens, temperature, seed, min_p: float = 0.0) -> list[Sample]:
        return self.engine.generate(prompts, n=n, max_tokens=max_tokens, temperature=temperature,
                                    seed=seed, min_p=min_p)

    def dist(self, temperature: float, min_p: float = 0.0) -> SamplingDist:
        """The distribution the engine's logprobs are of, for samples drawn with these settings."""
        return logprob_dist(self.cfg.logprobs, temperature, min_p)

    @torch.no_grad()
    def trainer_logprobs(self, samples: list[Sample], dist: SamplingDist = RAW, routes: list | None = None
                         ) -> list[torch.Tensor]:
        """The trainer's logprobs of `samples`, in packed forwards of at most max_packed_tokens tokens; `routes`
        (Qwen3-MoE): a list that gets each sample's expert ids."""
        out, chunk, size = [], [], 0
        for s in samples:
            if chunk and size + len(s.ids) > self.cfg.max_packed_tokens:
                out += self._forward(chunk, dist, routes)
                chunk, size = [], 0
            chunk.append(s)
            size += len(s.ids)
        if chunk:
            out += self._forward(chunk, dist, routes)
        return [t.cpu() for t in out]

    def _forward(self, chunk, dist, routes):
        lps, chunk_routes = sampled_logprobs_and_routes(self.model, chunk, "cuda", dist)
        if routes is not None and chunk_routes is not None:
            routes.extend(chunk_routes)
        return lps

    def compare(self, samples: list[Sample], temperature: float = 1.0, min_p: float = 0.0
                ) -> tuple[ParityReport, list[torch.Tensor]]:
        """Engine vs trainer logprobs of samples drawn with `temperature` and `min_p`; Qwen3-MoE: the experts of
        every token and sparse layer too (`report.routes`)."""
        routes = []
        trainer = self.trainer_logprobs(samples, self.dist(temperature, min_p), routes)
        report = compare_logprobs([s.logprobs for s in samples], trainer)
        report.routes = routes_report(samples, routes, self.model.args)
        return report, trainer
