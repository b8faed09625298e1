"""Does vLLM's own LoRA (`LoRARequest`) load a SPIRL adapter and compute what SPIRL trained?

    VLLM_BATCH_INVARIANT=1 python compare/lora_in_vllm.py --model BASE --adapter DIR

One vLLM engine built with `enable_lora=True` on the base checkpoint scores a few random sequences
(prompt_logprobs: the logprob of every token given its prefix) three ways: with the adapter as a
`LoRARequest`, without it, and SPIRL's trainer model with the adapter merged (W' = round(W + s B A),
what SPIRL's rollouts serve), all raw logprobs at temperature 1. vLLM's LoRA adds the low-rank
product to the bf16 base output instead of multiplying by a merged bf16 weight, so the two agree
within bf16 rounding, not bitwise. Pass: mean |vLLM+LoRA - SPIRL| <= 0.25 x mean |vLLM base - SPIRL|,
i.e. vLLM with the adapter is much closer to the trained policy than the base is (a misnamed or
unapplied adapter gives a ratio near 1). Exit 0 on pass, 1 on fail.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

RATIO_TOL = 0.25


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--adapter", required=True)
    p.add_argument("--lengths", default="33,200,517")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    p.add_argument("--json")
    a = p.parse_args(argv)

    import torch

    from spirl.numerics import vllm_patches
    from spirl.engines.vllm_engine import prepare_environment
    from spirl.core.config import TrainConfig
    from spirl.core.build import build_policy_and_engine
    from torchtitan_compat import model_args_from_hf_config
    from torchtitan_compat.config import ModelDir, load_hf_config
    from torchtitan_compat.peft_adapter import read_adapter

    prepare_environment()
    vllm_patches.apply()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    args = model_args_from_hf_config(load_hf_config(a.model))
    spec, _, _ = read_adapter(a.adapter, args)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 151669, (int(n),), generator=g).tolist() for n in a.lengths.split(",")]
    llm = LLM(model=a.model, skip_tokenizer_init=True, dtype="bfloat16", seed=0, enable_prefix_caching=False,
              gpu_memory_utilization=a.gpu_memory_utilization, max_model_len=4096, enforce_eager=True,
              enable_lora=True, max_lora_rank=max(8, spec.rank), max_loras=1, logprobs_mode="raw_logprobs")
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)

    def score(llm, lora):
        outs = llm.generate([TokensPrompt(prompt_token_ids=s) for s in seqs], params, use_tqdm=False,
                            lora_request=lora)
        return [torch.tensor([d[t].logprob for d, t in zip(o.prompt_logprobs[1:], s[1:])]) for o, s in zip(outs, seqs)]

    with_lora = score(llm, LoRARequest("spirl", 1, str(Path(a.adapter).resolve())))
    base = score(llm, None)
    llm.llm_engine.engine_core.shutdown()
    del llm

    # SPIRL's side on the native engine path (no second vLLM engine in this process): the trainer
    # model with the adapter merged, vLLM's kernels, bf16
    cfg = TrainConfig(model=a.model, engine="native", dtype="bfloat16", device="cuda", lora_init=a.adapter).validate()
    from spirl.core.lora import resolve_spec

    model = ModelDir.read(a.model)
    policy, _ = build_policy_and_engine(model, cfg.policy_spec(resolve_spec(cfg, model.args, model.path)),
                                        torch.device("cuda"))
    from spirl.numerics.samples import Sample
    from spirl.numerics.parity import sampled_logprobs
    from torchtitan_compat import select_backend

    policy.model.backend = select_backend("vllm", "cuda")
    with torch.no_grad():
        ours = [t.cpu() for t in sampled_logprobs(policy.model, [Sample(s[:1], s[1:], torch.empty(0)) for s in seqs],
                                                   "cuda")]
    d_lora = torch.cat([(x - y).abs() for x, y in zip(with_lora, ours)])
    d_base = torch.cat([(x - y).abs() for x, y in zip(base, ours)])
    ratio = float(d_lora.mean() / d_base.mean())
    ok = ratio <= RATIO_TOL
    result = {"tokens": int(d_lora.numel()), "rank": spec.rank, "targets": list(spec.targets),
              "mean_abs_diff_vllm_lora_vs_spirl": float(d_lora.mean()), "max_abs_diff_vllm_lora_vs_spirl":
              float(d_lora.max()), "mean_abs_diff_vllm_base_vs_spirl": float(d_base.mean()), "ratio": ratio,
              "tolerance": RATIO_TOL, "pass": ok}
    print(json.dumps(result))
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    sys.exit(main())
