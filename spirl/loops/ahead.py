"""--off-policy-steps K: rollouts sampled ahead of training, on a schedule fixed by K and the seed.

Schedule. The rollout of step j is sampled by the policy of version v(j) = max(0, j - 1 - K), the weights after
step v(j) (0: the initial ones). Before step 1 the rollouts of steps 1..K are sampled; during step s, the rollout
of step s + K, beside the trainer's forward and backward of step s. Its parity check and rewards run before step
s's first optimizer update, on the trainer's model, which then still holds the weights of version s - 1, the ones
the engine sampled with. So step s trains on samples min(s - 1, K) updates old (`offpolicy/staleness`, asserted
against the schedule at every step), and steps 1..K + 1 on samples of the initial weights: step 1 is the
synchronous run's step 1. K = 0 is the synchronous step (sample, check, train).

Behaviour logprobs. The loss's old logprobs are the engine's, checked bit for bit at sampling time against the
trainer's forward under those same weights (every token, and every route of a MoE). The ratio K makes different
from 1 is the policy's change over the stale updates, not a sampler-trainer mismatch; `ratio_mean`, `ratio_std`
and `ratio_clipped_frac` of a step's first mini-batch show it before this step's own updates move it further.

Repeatable. Which prompts, seeds and weights each rollout gets follows from K, --seed and the step numbers, never
from which side finishes first: a run repeats bit for bit. Checkpoints hold the K rollouts sampled ahead (every
rank's share, in order, `rollouts.json` and `rollouts.safetensors`), so --resume continues the schedule bit for
bit, on any number of ranks; a step's rollout scalars (rewards, parity, lengths) are computed when it is sampled
and logged with the step that trains on it.

Overlap. An engine that computes on its own (vLLM: `samples_beside_training`) samples on a thread of its own
while the trainer computes (Background says what overlaps); the native engine (the trainer's own model, on the CPU)
samples when its result is asked for, so its numbers never depend on what runs beside it.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..core.distributed import World, even_slices
from ..numerics.samples import Sample
from ..numerics.trajectory import Trajectory
from .update import Placeholder

ROLLOUTS_JSON, ROLLOUTS_TENSORS = "rollouts.json", "rollouts.safetensors"


def sampled_version(step: int, k: int) -> int:
    """The policy version (steps applied) whose weights sample the rollout of `step`."""
    return max(0, step - 1 - k)


@dataclass
class Ready:
    """A rollout sampled ahead, checked and scored, waiting for the step that trains on it."""

    step: int
    """The step that trains on it."""
    version: int
    """The policy version that sampled it (steps applied to the weights then)."""
    samples: list
    """This rank's share of the trained sequences (a Placeholder when it has none)."""
    advantages: torch.Tensor
    """float32 [len(samples)], over every rank's sequences."""
    scalars: dict
    """The rollout's scalars over every rank (spirl.loops.trainer.step_scalars)."""


class Background:
    """`fn()` computed beside the caller: on a thread of its own when `threaded`, else in the caller's thread when
    `result()` is first asked for. `seconds`: how long fn took.

    The thread issues its kernels to the device's current stream, the trainer's: vLLM's model runner launches
    on the stream it recorded when it was built, so tensors allocated under another stream here would be
    recycled by the caching allocator while its kernels still read them (an illegal memory access, seen on an
    H200). The two sides' host work (vLLM's scheduler and sampler, the trainer's Python) overlaps; their
    kernels queue on one stream."""

    def __init__(self, fn, threaded: bool, device: torch.device | None = None):
        self.fn, self.seconds, self.device = fn, 0.0, device
        self._out, self._error, self._thread = None, None, None
        if threaded:
            self._thread = threading.Thread(target=self._run, name="spirl-rollout", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        start = time.perf_counter()
        try:
            if self.device is not None and self.device.type == "cuda" and self.device.index is not None:
                torch.cuda.set_device(self.device)  # the current GPU is per thread: this rank's
            self._out = self.fn()
        except BaseException as e:  # re-raised in the caller's thread by result()
            self._error = e
        self.seconds = time.perf_counter() - start

    def join(self) -> None:
        """Wait for a thread still computing (nothing else: no result, no error raised)."""
        if self._thread is not None:
            self._thread.join()

    def result(self):
        if self._thread is None:
            if self.fn is not None:
                self._run()
                self.fn = None
        else:
            self._thread.join()
        if self._error is not None:
            raise self._error
        return self._out


class Ahead:
    """The rollouts sampled and not yet trained on, by the step that trains on each."""

    def __init__(self, k: int, pending: list[Ready] | None = None):
        self.k = k
        self.ready: dict[int, Ready] = {r.step: r for r in pending or []}

    def missing(self, step: int) -> list[int]:
        """The steps whose rollouts must be sampled before `step` trains: `step` itself with K = 0; with K > 0
        the steps step..step+K-1 not sampled yet (all of them only before a fresh run's step 1)."""
        return [j for j in range(step, step + max(self.k, 1)) if j not in self.ready]

    def put(self, ready: Ready) -> None:
        self.ready[ready.step] = ready

    def pop(self, step: int) -> Ready:
        """The rollout step trains on, checked against the schedule (module docstring)."""
        ready = self.ready.pop(step)
        if ready.version != sampled_version(step, self.k):
            raise RuntimeError(f"internal error: step {step} would train on samples of policy version "
                               f"{ready.version}, but --off-policy-steps {self.k} schedules version "
                               f"{sampled_version(step, self.k)}")
        return ready

    def pending(self) -> list[Ready]:
        """What a checkpoint written now must hold, in step order."""
        return [self.ready[j] for j in sorted(self.ready)]


def staleness(ready: Ready, step: int, k: int) -> dict:
    """offpolicy/staleness: how many updates separate the policy that trains `step` from the one that sampled
    its rollout (with K > 0; min(step - 1, K))."""
    return {"offpolicy/staleness": float(step - 1 - ready.version)} if k else {}


def first_ratio(metrics: dict) -> dict:
    """offpolicy/ratio_mean, ratio_std (from the per-sequence means of r and r^2) and ratio_clipped_frac of a
    step's first mini-batch: the ratio the stale updates alone made, before this step's own."""
    mean, sq = metrics["ratio_mean"], metrics["ratio_sq_mean"]
    return {"offpolicy/ratio_mean": mean, "offpolicy/ratio_std": max(sq - mean * mean, 0.0) ** 0.5,
            "offpolicy/ratio_clipped_frac": metrics["ratio_clipped_frac"]}


# -- checkpoints ----------------------------------------------------------------------------------------------


def encode_sequence(seq, tensors: dict, i: int) -> dict:
    """One sequence as JSON (ids, finish reason; a multi-turn Trajectory's own to_json), its float32 logprobs
    and uint8 routes as tensors `logprobs.i` / `routes.i` (bit for bit)."""
    if isinstance(seq, Trajectory):
        return {"trajectory": seq.to_json()}
    tensors[f"logprobs.{i}"] = seq.logprobs.detach().to(torch.float32).cpu().contiguous()
    if seq.routes is not None:
        tensors[f"routes.{i}"] = seq.routes.cpu().contiguous()
    return {"prompt_ids": list(seq.prompt_ids), "completion_ids": list(seq.completion_ids),
            "finish_reason": seq.finish_reason}


def decode_sequence(d: dict, tensors: dict, i: int):
    if "trajectory" in d:
        return Trajectory.from_json(d["trajectory"])
    return Sample(d["prompt_ids"], d["completion_ids"], tensors[f"logprobs.{i}"], d["finish_reason"],
                  tensors.get(f"routes.{i}"))


def gather_pending(pending: list[Ready], world: World) -> tuple[dict, dict[str, torch.Tensor]]:
    """Collective: the rollouts sampled ahead as (JSON, tensors), every rank's sequences in rank order (the
    shares are contiguous, so this is the order one process has), Placeholders left out."""
    doc, tensors, i = {"rollouts": []}, {}, 0
    for ready in pending:
        seqs, adv = [], []
        for samples, advantages in world.gather((ready.samples, ready.advantages)):
            for s, a in zip(samples, advantages.tolist()):
                if not isinstance(s, Placeholder):
                    seqs.append(s)
                    adv.append(a)
        tensors[f"advantages.{ready.step}"] = torch.tensor(adv, dtype=torch.float32)
        encoded = []
        for s in seqs:
            encoded.append(encode_sequence(s, tensors, i))
            i += 1
        doc["rollouts"].append({"step": ready.step, "version": ready.version, "scalars": ready.scalars,
                                "sequences": encoded})
    return doc, tensors


def write_doc(directory: Path, names: tuple[str, str], doc: dict, tensors: dict[str, torch.Tensor]) -> None:
    """A JSON document and its tensors (`names`: the two file names) into a checkpoint directory being written."""
    from safetensors.torch import save_file

    (directory / names[0]).write_text(json.dumps(doc, sort_keys=True) + "\n")
    save_file(tensors, str(directory / names[1]))


def read_doc(directory: Path, names: tuple[str, str]) -> tuple[dict, dict[str, torch.Tensor]]:
    """What write_doc wrote."""
    from safetensors.torch import load_file

    return json.loads((directory / names[0]).read_text()), load_file(str(directory / names[1]))


def write_pending(directory: Path, doc: dict, tensors: dict[str, torch.Tensor]) -> None:
    """rollouts.json and rollouts.safetensors into a checkpoint directory being written."""
    write_doc(directory, (ROLLOUTS_JSON, ROLLOUTS_TENSORS), doc, tensors)


def read_pending(directory: Path, world: World, group_size: int) -> list[Ready]:
    """The rollouts a checkpoint holds, each rank's share cut as spirl.loops.rollout cuts it (contiguous whole
    groups, even_slices over the ranks; a rank without one gets a zero-weight Placeholder): any number of ranks."""
    doc, tensors = read_doc(directory, (ROLLOUTS_JSON, ROLLOUTS_TENSORS))
    out, i = [], 0
    for r in doc["rollouts"]:
        seqs = []
        for d in r["sequences"]:
            seqs.append(decode_sequence(d, tensors, i))
            i += 1
        adv = tensors[f"advantages.{r['step']}"]
        share = even_slices(len(seqs) // group_size, world.size)[world.rank]
        rows = slice(share.start * group_size, share.stop * group_size)
        samples, advantages = seqs[rows], adv[rows]
        if not samples and seqs:  # this rank trains nothing that step: a zero-weight pass keeps collectives paired
            samples, advantages = [Placeholder(seqs[0])], torch.zeros(1)
        out.append(Ready(r["step"], r["version"], samples, advantages, r["scalars"]))
    return out
