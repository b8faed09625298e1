"""spirl.core.memory_plan: the GPU memory estimate (by hand on a small shape, exact parameter counts), and
the one-line refusals that name the flag to change. No GPU needed: the device's bytes are passed in."""

from __future__ import annotations

import dataclasses
import math
import re

import pytest

from spirl.core import memory_plan as mp
from spirl.core.config import TrainConfig
from spirl.core.errors import EXIT_MEMORY, UserError
from torchtitan_compat.config import hf_config_for_shape, model_args_from_hf_config

GIB = 2**30


def args_of(shape: str, layers: int | None = None):
    return model_args_from_hf_config(hf_config_for_shape(shape, layers))


@pytest.mark.parametrize("shape", ["tiny", "Qwen3-0.6B", "Qwen3-1.7B"])
def test_param_count_is_the_checkpoints(shape):
    from weights import expected_hf_shapes

    a = args_of(shape, 2)
    assert mp.param_count(a) == sum(math.prod(s) for s in expected_hf_shapes(a).values())


def test_estimate_by_hand():
    """tiny (dim 128, 2 layers, 4 heads / 2 kv heads x 128, hidden 384, vocab 151936, untied),
    float32, every part written out."""
    a = args_of("tiny")
    assert (a.dim, a.n_layers, a.n_heads, a.n_kv_heads, a.head_dim, a.hidden_dim, a.vocab_size) == \
        (128, 2, 4, 2, 128, 384, 151936) and not a.enable_weight_tying
    p = mp.param_count(a)
    cfg = TrainConfig(engine="vllm", dtype="float32", kl_coef=0.1, prompts_per_step=2, group_size=4,
                      updates_per_batch=1, max_tokens_per_microbatch=100, activation_checkpointing=1,
                      gpu_memory_utilization=0.25)
    est = mp.estimate(a, cfg, 64 * GIB, max_seq_len=30)
    t = 100  # min(max(100, 30), 8 sequences x 30 = 240)
    assert est.tokens_per_microbatch == t
    layer = t * (2 * 512 + 3 * 256 + 4 * 384 + 6 * 128) * 4  # q = 512, kv = 256 elements per token
    assert est.parts == {
        "fp32 masters": 4 * p, "compute model": 4 * p, "reference": 4 * p, "AdamW state": 8 * p,
        "fp32 grads": 4 * p, "compute grads": 4 * p,
        "activations": 2 * t * 128 * 4 + 2 * layer + 2 * t * 128 * 4,
        "logits": 2 * t * 151936 * 4, "vLLM": 16 * GIB, "overhead": GIB,
    }
    assert est.total == sum(est.parts.values()) and est.fits
    # without activation checkpointing: every layer's activations, plus one layer's gradients
    no_ckpt = mp.estimate(a, dataclasses.replace(cfg, activation_checkpointing=0), 64 * GIB, max_seq_len=30)
    assert no_ckpt.parts["activations"] == 2 * layer + layer + 2 * t * 128 * 4
    # lm_head in chunks: three chunk-sized float32 temporaries at most
    chunked = mp.estimate(a, cfg, 64 * GIB, max_seq_len=30, logits_chunk_elements=1 << 20)
    assert chunked.parts["logits"] == 3 * (1 << 20) * 4
    # no KL term: no reference copy; the native engine: no vLLM share
    assert mp.estimate(a, dataclasses.replace(cfg, kl_coef=0.0), 64 * GIB, max_seq_len=30).parts["reference"] == 0
    assert mp.estimate(a, dataclasses.replace(cfg, engine="native"), 64 * GIB, max_seq_len=30).parts["vLLM"] == 0
    # K = 1 with the engine on a GPU of its own: no vLLM share here, and the weights a rollout is checked on after
    # the update kept (the compute model's copy; sharded: this rank's fp32 shards of the masters)
    split = dataclasses.replace(cfg, off_policy_steps=1, generation_gpus=1)
    one = mp.estimate(a, split, 64 * GIB, max_seq_len=30).parts
    assert one["vLLM"] == 0 and one["weights kept for the check"] == 4 * p
    bf16 = mp.estimate(a, dataclasses.replace(split, dtype="bfloat16"), 64 * GIB, max_seq_len=30, shards=2).parts
    assert bf16["weights kept for the check"] == 4 * p // 2
    assert "weights kept for the check" not in mp.estimate(a, dataclasses.replace(split, dynamic_sampling=1), 64 * GIB,
                                                           max_seq_len=30).parts


def test_tokens_per_microbatch_bounds():
    cfg = TrainConfig(prompts_per_step=8, group_size=8, updates_per_batch=2, max_tokens_per_microbatch=1000)
    assert mp.tokens_per_microbatch(cfg, 50) == 1000  # 32 sequences x 50 = 1600 > budget
    assert mp.tokens_per_microbatch(cfg, 20) == 640  # the whole mini-batch is smaller than the budget
    assert mp.tokens_per_microbatch(cfg, 3000) == 3000  # a longer sequence gets a micro-batch of its own


def test_default_run_fits_an_h100_but_not_a_small_gpu():
    a = args_of("Qwen3-1.7B")
    cfg = TrainConfig()  # vLLM, bf16, 8 x 8 completions of 16 tokens
    est = mp.check(a, cfg, 80 * GIB, max_seq_len=60)
    assert est.fits and 50 * GIB < est.total < 80 * GIB
    with pytest.raises(UserError) as e:
        mp.check(a, cfg, 24 * GIB, "cuda:0 (RTX)", max_seq_len=60)
    assert e.value.exit_code == EXIT_MEMORY
    msg = str(e.value)
    assert "\n" not in msg and re.search(r"needs about [\d.]+ GiB of GPU memory but cuda:0 \(RTX\) has 24\.0 GiB", msg)
    assert "weights and optimizer state alone do not fit" in msg


CHUNKED = dict(max_seq_len=300, logits_chunk_elements=1 << 27)


@pytest.mark.parametrize("change, gpu_gib, flag", [
    (dict(activation_checkpointing=0), 30, r"set --activation-checkpointing 1"),
    (dict(max_tokens_per_microbatch=65536, prompts_per_step=64), 24, r"lower --max-tokens-per-microbatch to \d+"),
    (dict(gpu_memory_utilization=0.6), 24, r"lower --gpu-memory-utilization to 0\.\d+ \(now 0\.6\)"),
    (dict(kl_coef=0.1, engine="native", dtype="float32"), 22, r"set --kl-coef 0"),
    pytest.param(dict(gpu_memory_utilization=0.6), 24, r"set --vllm-sleep 1",
                 marks=pytest.mark.skipif(not hasattr(TrainConfig(), "vllm_sleep"), reason="no --vllm-sleep")),
])
def test_refusal_names_the_flag_that_makes_it_fit(change, gpu_gib, flag):
    a = args_of("Qwen3-0.6B")
    cfg = dataclasses.replace(TrainConfig(), **change)
    assert mp.estimate(a, cfg, 80 * GIB, **CHUNKED).fits  # it is the GPU that is too small
    with pytest.raises(UserError) as e:
        mp.check(a, cfg, gpu_gib * GIB, "cuda:0 (GPU)", **CHUNKED)
    msg = str(e.value)
    assert e.value.exit_code == EXIT_MEMORY and "\n" not in msg and re.search(flag, msg), msg
    # the change it names does make the estimate fit
    name, value = re.search(r"--([a-z-]+) (?:to )?([\d.]+)", re.search(flag, msg).group(0)).groups()
    field = name.replace("-", "_")
    fixed = dataclasses.replace(cfg, **{field: type(getattr(cfg, field))(float(value))})
    assert mp.estimate(a, fixed, gpu_gib * GIB, **CHUNKED).fits


def _apply(cfg, msg: str):
    """`cfg` with every change one refusal's "together: ..." names, at the values it names."""
    together = msg.split("together: ")[1]
    change = {}
    for name, value in re.findall(r"--([a-z-]+) (?:to )?([\w.]+)", together):
        field = name.replace("-", "_")
        old = getattr(cfg, field)
        change[field] = value if isinstance(old, str) else type(old)(float(value))
    return dataclasses.replace(cfg, **change), change


@pytest.mark.parametrize("shape, change, gpu_gib, shards, named", [
    # the fewest switches: not checkpointing's recompute or the KL term (the objective), the engine asleep
    ("Qwen3-0.6B", dict(activation_checkpointing=0, kl_coef=0.1), 16, 0, {"vllm_sleep", "max_tokens_per_microbatch"}),
    # nothing but the reference copy's memory: the KL term goes (the objective changes), named last resort
    ("Qwen3-0.6B", dict(activation_checkpointing=0, kl_coef=0.1, engine="native", dtype="float32"), 16, 0,
     {"kl_coef", "max_tokens_per_microbatch"}),
    # Qwen3-8B full fine-tuning on 2 H100s (the scale-out issue): the engine asleep while training, smaller
    # micro-batches; the plan is 131 GiB on 2 H200s at the defaults
    ("Qwen3-8B", dict(max_new_tokens=1024), 79.2, 2, {"vllm_sleep", "max_tokens_per_microbatch"}),
])
def test_refusal_when_no_single_flag_is_enough_names_values_that_fit_together(shape, change, gpu_gib, shards, named):
    a = args_of(shape)
    cfg = dataclasses.replace(TrainConfig(), **change)
    kw = dict(CHUNKED, shards=shards) if shards else CHUNKED
    with pytest.raises(UserError) as e:
        mp.check(a, cfg, int(gpu_gib * GIB), **kw)
    msg = str(e.value)
    assert "no single flag is enough; together: " in msg and "\n" not in msg, msg
    fixed, applied = _apply(cfg, msg)
    assert set(applied) == named, msg
    assert mp.check(a, fixed, int(gpu_gib * GIB), **kw).fits
    for switch in set(applied) - {"max_tokens_per_microbatch", "gpu_memory_utilization"}:  # each one is needed
        assert not mp.estimate(a, dataclasses.replace(fixed, **{switch: getattr(cfg, switch)}), int(gpu_gib * GIB),
                               **kw).fits


def test_more_tokens_or_no_checkpointing_never_need_less():
    a = args_of("tiny")
    base = TrainConfig(prompts_per_step=64, group_size=8)
    sizes = [mp.estimate(a, dataclasses.replace(base, max_tokens_per_microbatch=b), 80 * GIB, max_seq_len=200).total
             for b in (256, 1024, 4096, 16384)]
    assert sizes == sorted(sizes) and sizes[0] < sizes[-1]
    on = mp.estimate(a, base, 80 * GIB, max_seq_len=200)
    off = mp.estimate(a, dataclasses.replace(base, activation_checkpointing=0), 80 * GIB, max_seq_len=200)
    assert off.parts["activations"] > on.parts["activations"]


def _lora32(**kw):
    from torchtitan_compat.lora import LoRASpec, parse_targets

    cfg = TrainConfig(lora_rank=32, max_new_tokens=1024, **kw)
    return cfg, dict(max_seq_len=1100, logits_chunk_elements=1 << 27, lora=LoRASpec(32, 32.0, parse_targets("")))


def test_qwen3_32b_lora_per_gpu_plan():
    """Qwen3-32B LoRA on several ranks: every GPU holds the engine's whole bf16 model (61 GiB) and trains on it.
    On a 139 GiB H200 it fits with a larger engine share; on an 80 GB card only with most of the card for the
    engine and small micro-batches (one line says both, and both together fit); on 48 GB no share can."""
    a = args_of("Qwen3-32B")
    cfg, kw = _lora32(gpu_memory_utilization=0.6)
    assert mp.check(a, cfg, int(139.8 * GIB), **kw).fits
    cfg, kw = _lora32()
    with pytest.raises(UserError) as e:
        mp.check(a, cfg, int(79.2 * GIB), "cuda:0 (H100)", **kw)
    msg = str(e.value)
    got = re.search(r"bf16 weights are 61\.0 GiB .* raise it to at least (0\.\d+) and lower --max-tokens-per-microbatch "
                    r"to (\d+) \(now 16384\)$", msg)
    assert got and e.value.exit_code == EXIT_MEMORY, msg
    fixed = dataclasses.replace(cfg, gpu_memory_utilization=float(got[1]), max_tokens_per_microbatch=int(got[2]))
    assert mp.check(a, fixed, int(79.2 * GIB), **kw).fits
    with pytest.raises(UserError, match=r"the rollout engine's bf16 weights alone are 61\.0 GiB on every GPU.*use GPUs "
                                        r"with at least \d+ GiB, or a smaller model \(tensor-parallel engines"):
        mp.check(a, cfg, 48 * GIB, "cuda:0 (L40S)", **kw)


def test_the_engine_share_holds_one_max_model_len_sequence_of_kv():
    a = args_of("Qwen3-8B")
    assert mp.kv_bytes_per_token(a) == 2 * 2 * 36 * 8 * 128  # K and V, bf16, every layer
    assert mp.min_kv_bytes(a, TrainConfig(max_model_len=32768)) == 32768 * mp.kv_bytes_per_token(a)
    assert mp.min_kv_bytes(args_of("tiny"), TrainConfig(max_model_len=64)) == mp.MIN_VLLM_KV_BYTES


def test_host_memory_plan_counts_every_rank_of_the_host():
    """Qwen3-32B LoRA on the 2 ranks of a 251 GiB host: two pinned frozen bases (58 GiB each, in 60 GiB of pinned
    buffers) and one rank
    reading the checkpoint at a time (spirl.core.lora takes turns: the bf16 model once plus its largest tensor,
    out of which that rank's base is pinned) fit; four ranks on a 230 GiB host do not, and the one line names
    --lora-base gpu. 8B full fine-tuning: 4 FSDP ranks read the fp32 model at once."""
    from torchtitan_compat.lora import LoRASpec, parse_targets

    a = args_of("Qwen3-32B")
    lora = LoRASpec(32, 32.0, parse_targets(""))
    cfg = TrainConfig(lora_rank=32)
    two = mp.check_host(a, cfg, 251 * GIB, local_ranks=2, lora=lora)
    adapted = sum(n for k, n in mp.host_estimate(a, cfg, 1, lora).parts.items() if k == "pinned frozen base")
    raw = mp._lora_parts(a, dataclasses.replace(cfg, lora_base="gpu"), lora, 2)["frozen base"]
    assert two.parts["pinned frozen base"] == 2 * adapted and 57 * GIB < raw < adapted <= 60 * GIB  # 2 GiB buffers
    assert two.parts["reading the checkpoint"] == 2 * (mp.param_count(a) + a.vocab_size * a.dim) - raw
    with pytest.raises(UserError, match=r"^4 ranks of this host need about [\d.]+ GiB of host memory at the peak .* "
                                        r"this host has 230\.0 GiB: set --lora-base gpu"):
        mp.check_host(a, cfg, 230 * GIB, local_ranks=4, lora=lora)
    assert mp.host_estimate(a, dataclasses.replace(cfg, lora_base="gpu"), 4, lora).parts["pinned frozen base"] == 0
    p8 = mp.param_count(args_of("Qwen3-8B"))
    full = mp.host_estimate(args_of("Qwen3-8B"), TrainConfig(), local_ranks=4, shards=4)
    assert full.parts["reading the checkpoint"] == 4 * 8 * p8  # bf16 file + fused layout + fp32 model, per rank
    assert mp.host_estimate(args_of("Qwen3-8B"), TrainConfig()).parts["reading the checkpoint"] == 12 * p8  # a gather


def test_too_big_for_one_trainer_gpu_names_the_ranks_that_fit():
    """Qwen3-8B full fine-tuning with its engine on a GPU of its own does not fit one H200's trainer: the error
    names the trainer ranks whose shards fit (and the engine GPUs they take), not LoRA, which such runs refuse."""
    a = args_of("Qwen3-8B")
    cfg = TrainConfig(generation_gpus=1, off_policy_steps=1, prompts_per_step=6, group_size=8, max_new_tokens=768)
    with pytest.raises(UserError) as e:
        mp.check(a, cfg, int(139.8 * GIB), "cuda:0 (H200)", max_seq_len=1024)
    msg = str(e.value)
    assert "\n" not in msg and "alone do not fit" in msg
    assert "shard it over 2 trainer ranks (torchrun --nproc-per-node 2 with --generation-gpus 2: 4 GPUs)" in msg
    assert "--lora-rank" not in msg
    assert mp.estimate(a, cfg, int(139.8 * GIB), max_seq_len=1024, shards=2).fits  # what the message promises
    colocated = TrainConfig(prompts_per_step=6, group_size=8, max_new_tokens=768)
    with pytest.raises(UserError) as e:
        mp.check(a, colocated, int(139.8 * GIB), "cuda:0 (H200)", max_seq_len=1024)
    assert re.search(r"shard it over \d+ trainer ranks \(torchrun --nproc-per-node \d+\), or train LoRA", str(e.value))
