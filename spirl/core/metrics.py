"""Per-step metrics: TensorBoard scalars, one JSON line per step, run metadata, a console line.

Everything goes under <out_dir>/<run_name>/ (TensorBoard event files, metrics.jsonl,
run_metadata.json); both writers are flushed after every step so a crash loses nothing logged,
and a resumed run drops the lines of steps after its checkpoint before logging them again.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import re
from pathlib import Path

import torch

log = logging.getLogger("spirl.core.metrics")


def layer_of(param_name: str) -> str:
    """'layers.3.attention.qkv_proj.weight' -> 'layers.3'; 'tok_embeddings.weight' -> 'tok_embeddings'."""
    m = re.match(r"(layers\.\d+)\.", param_name)
    return m.group(1) if m else param_name.split(".")[0]


def versions() -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version(), "torch": torch.__version__}
    for pkg in ("vllm", "torchtitan", "transformers", "safetensors"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out


def gpu_name() -> str | None:
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


class MetricsLogger:
    """`resume_step`: the run continues from that step's checkpoint, so lines of later steps in an
    existing metrics.jsonl (logged after that checkpoint, then lost with the interrupted run) and
    any cut-off last line are dropped; the resumed run logs those steps again. Both writers are
    flushed after every step; `close` may be called more than once."""

    def __init__(self, run_dir: str | Path, metadata: dict, resume_step: int | None = None):
        from torch.utils.tensorboard import SummaryWriter

        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        meta = {**metadata, "versions": versions(), "gpu": gpu_name()}
        (self.run_dir / "run_metadata.json").write_text(json.dumps(meta, indent=1, default=str) + "\n")
        if resume_step is not None:
            self._truncate_after(resume_step)
        self.tb = SummaryWriter(log_dir=str(self.run_dir))
        # append: a resumed run under the same name continues the same file
        self.jsonl = open(self.run_dir / "metrics.jsonl", "a")
        self._closed = False

    def _truncate_after(self, step: int) -> None:
        path = self.run_dir / "metrics.jsonl"
        if not path.is_file():
            return
        kept, dropped = [], 0
        for line in path.read_text().splitlines():
            try:
                ok = json.loads(line)["step"] <= step
            except (json.JSONDecodeError, KeyError, TypeError):
                ok = False
            if ok:
                kept.append(line)
            else:
                dropped += 1
        if dropped:
            tmp = path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(line + "\n" for line in kept))
            os.replace(tmp, path)
            log.info("metrics.jsonl: dropped %d line(s) after step %d (the run resumes from there)", dropped, step)

    def log_step(self, step: int, scalars: dict[str, float], total_steps: int) -> None:
        for k, v in scalars.items():
            self.tb.add_scalar(k, v, step)
        self.tb.flush()
        self.jsonl.write(json.dumps({"step": step, **scalars}) + "\n")
        self.jsonl.flush()
        kl = f"  kl {scalars['kl_div']:.2e}" if "kl_div" in scalars else ""  # only with a KL term (--kl-coef > 0)
        seconds = scalars.get("time/step", sum(v for k, v in scalars.items() if k.startswith("time/")))
        log.info("step %d/%d  reward %.3f±%.3f  loss %.4f%s  parity %d/%d diff  %.1fs",
                 step, total_steps, scalars.get("reward_mean", float("nan")), scalars.get("reward_std", float("nan")),
                 scalars.get("loss", float("nan")), kl,
                 int(scalars.get("parity/tokens_different", -1)), int(scalars.get("parity/tokens_compared", -1)),
                 seconds)
        if "episode/turns_mean" in scalars:
            log.info("step %d/%d  multi-turn: %.2f turns/episode, %.2f env errors/episode, naive retokenization "
                     "would differ in %d tokens (%d trained, %d smoking guns); TI/TO: 0",
                     step, total_steps, scalars["episode/turns_mean"], scalars["episode/env_errors_mean"],
                     int(scalars.get("retok/naive_tokens_differing", -1)),
                     int(scalars.get("retok/naive_trained_tokens_differing", -1)),
                     int(scalars.get("retok/smoking_guns", -1)))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.jsonl.close()
        finally:
            self.tb.close()
