"""In-memory weight update of the vLLM engine vs the save-safetensors-and-reload way, side by side.

    VLLM_BATCH_INVARIANT=1 python compare/weight_sync_bench.py --model DIR [--repeats 3]

Both ways load the trainer's bf16 tensors into the running engine's model; the disk way first
writes them with safetensors and reads them back. Prints the median seconds of each and their
ratio, and checks that generation after an update is bitwise what it was before (same weights).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

import weights_vllm_compat as wvc  # noqa: E402
from compare.harness import HarnessConfig, ParityHarness  # noqa: E402


def in_memory(harness) -> float:
    sd = harness.model.state_dict()
    return harness.engine.load_weights(wvc.compat_to_vllm_weights(sd, harness.model.args))


def via_disk(harness, tmp: Path) -> float:
    t0 = time.perf_counter()
    hf = {k: v.contiguous() for k, v in wvc.compat_to_hf(harness.model.state_dict(), harness.model.args).items()}
    save_file(hf, str(tmp / "model.safetensors"))
    with safe_open(str(tmp / "model.safetensors"), framework="pt", device="cuda") as f:
        harness.engine.load_weights((k, f.get_tensor(k)) for k in f.keys())
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    harness = ParityHarness(HarnessConfig(args.model))
    prompts = [[1, 2, 3, 4, 5] * 20, [7] * 3]
    before = harness.generate(prompts, 2, 32, 1.0, 0)
    mem = [in_memory(harness) for _ in range(args.repeats)]
    with tempfile.TemporaryDirectory() as d:
        disk = [via_disk(harness, Path(d)) for _ in range(args.repeats)]
    after = harness.generate(prompts, 2, 32, 1.0, 0)
    same = all(a.completion_ids == b.completion_ids and torch.equal(a.logprobs, b.logprobs)
               for a, b in zip(before, after))
    n_params = sum(t.numel() for t in harness.model.state_dict().values())
    m, d = statistics.median(mem), statistics.median(disk)
    print(f"weights: {n_params / 1e9:.2f}B params (bf16)")
    print(f"in-memory update: median {m:.3f}s over {args.repeats} ({', '.join(f'{x:.3f}' for x in mem)})")
    print(f"save+reload:      median {d:.3f}s over {args.repeats} ({', '.join(f'{x:.3f}' for x in disk)})")
    print(f"ratio save+reload / in-memory: {d / m:.1f}x")
    print(f"generation after reloading the same weights bitwise unchanged: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
