"""config.json as transformers writes it -> the model computes transformers' logits; anything
the model cannot compute exactly is refused in one line.

Checkpoints are written by transformers' own `Qwen3ForCausalLM(Qwen3Config(...)).save_pretrained`
(a 5.x config.json: `rope_parameters`, no top-level `rope_theta`) in deliberately odd, tiny
configurations, plus one config.json rewritten into the transformers-4.x shape (top-level
`rope_theta`, `rope_scaling: null`).

Tolerance: both sides run in float64, so they differ by float64 rounding only: we require
max |Δlogit| <= 1e-10 * max|logit| (observed: ~1e-15 relative). Two float32 steps would cap the
agreement at ~1e-7, so they are kept equal on both sides: RoPE's cos/sin table is built in
float32 by transformers, vLLM and us alike; and transformers' RMSNorm casts its input to float32
whatever the model dtype, so for the comparison it runs in float64 (`hf_logits`). The errors the
check exists for are far larger (measured on these configs): rope_theta 1e6 instead of the saved
value moves logits by 4-33% of their scale, rms_norm_eps 1e-5 instead of 1e-6 by ~1%
(`test_wrong_config_values_would_not_match`).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from test_model_vs_hf import max_rel_error, our_logits, random_sequences
from transformers import Qwen3Config, Qwen3ForCausalLM
from transformers.models.qwen3 import modeling_qwen3

import weights
from torchtitan_compat.config import SHAPES, ConfigError, hf_config_for_shape, model_args_from_hf_config
from weights import WeightsError, load_hf_checkpoint
from weights_vllm_compat import load_model

REL_TOL = 1e-10  # float64 on both sides; see the module docstring
LENGTHS = [1, 6, 19, 131]  # ragged, one crossing the 128-row attention block

# Odd on purpose, each unlike Qwen3's real shapes; all tiny so the suite stays fast on 2 cores.
CONFIGS = {
    # untied, GQA ratio 2, rope_theta 1e4 (written out: it is transformers' default, not vLLM's)
    "untied_gqa2_theta1e4": dict(
        vocab_size=389, hidden_size=64, intermediate_size=112, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, rope_theta=1e4, rms_norm_eps=1e-6, tie_word_embeddings=False,
        max_position_embeddings=512),
    # tied, GQA ratio 6 (one kv head), head_dim 24 != 48 / 6, rope_theta 5e5, rms_norm_eps 1e-5, 1 layer
    "tied_gqa6_headdim24_theta5e5": dict(
        vocab_size=271, hidden_size=48, intermediate_size=80, num_hidden_layers=1, num_attention_heads=6,
        num_key_value_heads=1, head_dim=24, rope_theta=5e5, rms_norm_eps=1e-5, tie_word_embeddings=True,
        max_position_embeddings=256),
    # untied, GQA ratio 1 (MHA), head_dim 40 != 96 / 3, 3 layers, rope_theta 3e4, rms_norm_eps 1e-5,
    # max_position_embeddings left to transformers' default
    "mha_headdim40_3layers_theta3e4": dict(
        vocab_size=613, hidden_size=96, intermediate_size=160, num_hidden_layers=3, num_attention_heads=3,
        num_key_value_heads=3, head_dim=40, rope_theta=3e4, rms_norm_eps=1e-5, tie_word_embeddings=False),
}
LEGACY = "untied_gqa2_theta1e4_as_4x"  # the first config, its config.json rewritten in the 4.x shape


def write_hf_checkpoint(out, rope_theta, seed=0, **kwargs):
    """transformers' own checkpoint for a Qwen3Config; norm weights randomized so that they matter."""
    cfg = Qwen3Config(rope_parameters={"rope_type": "default", "rope_theta": rope_theta}, **kwargs)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    model.save_pretrained(out)
    return out


def rewrite_config(src, dst, edit):
    """Copy of checkpoint `src` whose config.json is `edit(config dict)`."""
    shutil.copytree(src, dst)
    cfg = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(edit(cfg), indent=2))
    return dst


def to_4x_shape(cfg: dict) -> dict:
    """A transformers-5.x config.json dict rewritten as 4.51 writes it: top-level rope_theta and
    rope_scaling instead of rope_parameters, torch_dtype instead of dtype, no layer_types."""
    rope = cfg["rope_parameters"]
    assert rope["rope_type"] == "default" and "rope_theta" not in cfg
    old = {k: v for k, v in cfg.items() if k not in ("rope_parameters", "dtype", "layer_types")}
    return {**old, "rope_theta": rope["rope_theta"], "rope_scaling": None, "torch_dtype": cfg["dtype"]}


@pytest.fixture(scope="module")
def checkpoints(module_dir):
    tmp = module_dir
    dirs = {name: write_hf_checkpoint(tmp / name, **kw) for name, kw in CONFIGS.items()}
    dirs[LEGACY] = rewrite_config(dirs["untied_gqa2_theta1e4"], tmp / LEGACY, to_4x_shape)
    return dirs


def hf_logits(model_dir, sequences, monkeypatch):
    """transformers' float64 logits, its RMSNorm kept in float64 (it casts to float32 otherwise)."""
    def rms_norm_in_input_dtype(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    monkeypatch.setattr(modeling_qwen3.Qwen3RMSNorm, "forward", rms_norm_in_input_dtype)
    # sdpa: the eager path takes the attention softmax in float32
    hf = Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float64, attn_implementation="sdpa").eval()
    with torch.no_grad():
        return [hf(torch.tensor([s])).logits[0] for s in sequences]


def ours_float64(model_dir, sequences):
    load_hf_checkpoint(model_dir)  # the weights.py loader accepts it too
    return our_logits(load_model(model_dir, device="cpu", dtype=torch.float64, backend="reference"), sequences)


def config_of(model_dir) -> dict:
    return json.loads((model_dir / "config.json").read_text())


@pytest.mark.parametrize("name", [*CONFIGS, LEGACY])
def test_logits_match_transformers_in_float64(checkpoints, name, monkeypatch):
    model_dir = checkpoints[name]
    seqs = random_sequences(seed=1, lengths=LENGTHS, vocab=config_of(model_dir)["vocab_size"])
    ours = ours_float64(model_dir, seqs)
    assert all(o.dtype == torch.float64 for o in ours)
    err, scale = max_rel_error(ours, hf_logits(model_dir, seqs, monkeypatch))
    print(f"{name}: max|Δlogit| {err:.3e} at max|logit| {scale:.3e}")
    assert err <= REL_TOL * scale, f"max|Δlogit|={err:.3e} vs max|logit|={scale:.3e}"


@pytest.mark.parametrize("name", list(CONFIGS))
def test_model_args_are_the_saved_config(checkpoints, name):
    kw = CONFIGS[name]
    a = model_args_from_hf_config(config_of(checkpoints[name]))
    got = dict(dim=a.dim, n_layers=a.n_layers, n_heads=a.n_heads, n_kv_heads=a.n_kv_heads, head_dim=a.head_dim,
               hidden_dim=a.hidden_dim, vocab_size=a.vocab_size, rope_theta=a.rope_theta, norm_eps=a.norm_eps,
               enable_weight_tying=a.enable_weight_tying, max_seq_len=a.max_seq_len)
    assert got == dict(
        dim=kw["hidden_size"], n_layers=kw["num_hidden_layers"], n_heads=kw["num_attention_heads"],
        n_kv_heads=kw["num_key_value_heads"], head_dim=kw["head_dim"], hidden_dim=kw["intermediate_size"],
        vocab_size=kw["vocab_size"], rope_theta=kw["rope_theta"], norm_eps=kw["rms_norm_eps"],
        enable_weight_tying=kw["tie_word_embeddings"],
        max_seq_len=kw.get("max_position_embeddings", Qwen3Config().max_position_embeddings))


def test_4x_and_5x_config_shapes_give_the_same_model_args(checkpoints):
    new, old = config_of(checkpoints["untied_gqa2_theta1e4"]), config_of(checkpoints[LEGACY])
    assert "rope_theta" not in new and new["rope_parameters"]["rope_theta"] == 1e4  # as transformers 5.x writes it
    assert "rope_parameters" not in old and old["rope_theta"] == 1e4 and old["rope_scaling"] is None
    assert model_args_from_hf_config(new) == model_args_from_hf_config(old)
    # a 5.x file that also keeps the same top-level value is fine too
    assert model_args_from_hf_config({**new, "rope_theta": 10000}) == model_args_from_hf_config(new)


def test_old_reader_took_the_wrong_rope_theta(checkpoints):
    """The bug: the old reader took `cfg.get("rope_theta", 1000000)` from a 5.x config.json, i.e. 1e6
    instead of the 1e4 in rope_parameters."""
    cfg = config_of(checkpoints["untied_gqa2_theta1e4"])
    assert cfg.get("rope_theta", 1000000) == 1000000 != cfg["rope_parameters"]["rope_theta"]
    assert model_args_from_hf_config(cfg).rope_theta == 1e4


@pytest.mark.parametrize("wrong", [
    {"rope_parameters": {"rope_type": "default", "rope_theta": 1000000}},  # what the old reader used
    {"rms_norm_eps": 1e-5},
], ids=["old_default_rope_theta", "rms_norm_eps"])
def test_wrong_config_values_would_not_match(checkpoints, tmp_path, monkeypatch, wrong):
    """The parity check has teeth: a model built from a config.json that differs from the saved
    one in a single value fails it by orders of magnitude."""
    src = checkpoints["untied_gqa2_theta1e4"]
    changed = rewrite_config(src, tmp_path / "changed", lambda c: {**c, **wrong})
    seqs = random_sequences(seed=1, lengths=LENGTHS, vocab=config_of(src)["vocab_size"])
    err, scale = max_rel_error(ours_float64(changed, seqs), hf_logits(src, seqs, monkeypatch))
    assert err > 1e-3 * scale, f"{wrong} went unnoticed: max|Δ|={err:.3e} at max|logit| {scale:.3e}"


def test_missing_fields_get_the_defaults_transformers_and_vllm_share():
    """Leaving out a field both readers default alike gives that default (transformers' Qwen3Config,
    which vLLM reads as-is): not the values of Qwen3's real checkpoints that the old code assumed."""
    cfg = hf_config_for_shape("tiny")
    for k in ("rms_norm_eps", "tie_word_embeddings", "max_position_embeddings", "hidden_act", "attention_bias",
              "use_sliding_window", "sliding_window", "attention_dropout", "rope_scaling"):
        del cfg[k]
    a, d = model_args_from_hf_config(cfg), Qwen3Config()
    assert (a.norm_eps, a.enable_weight_tying, a.max_seq_len) == (d.rms_norm_eps, d.tie_word_embeddings,
                                                                  d.max_position_embeddings)
    assert (a.norm_eps, a.enable_weight_tying, a.max_seq_len) == (1e-6, False, 32768)


def _without(*keys):
    return lambda c: {k: v for k, v in c.items() if k not in keys}


def _with(**kv):
    return lambda c: {**c, **kv}


def _5x(rope_parameters):
    """The 5.x shape: RoPE settings only in rope_parameters."""
    return lambda c: {**_without("rope_theta", "rope_scaling")(c), "rope_parameters": rope_parameters}


# case -> (edit of the tiny shape's config.json dict, the field the message must name)
REFUSED = {
    "yarn_4x": (_with(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}),
                "rope_scaling"),
    "linear_legacy_type_key": (_with(rope_scaling={"type": "linear", "factor": 2.0}), "rope_scaling"),
    "dynamic_5x": (_5x({"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6}), "rope_parameters"),
    "llama3_5x": (_5x({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 8192, "rope_theta": 5e5}), "rope_parameters"),
    "extra_rope_key": (_5x({"rope_type": "default", "rope_theta": 1e6, "mrope_section": [8, 12, 12]}),
                       "rope_parameters"),
    "partial_rotary": (_with(partial_rotary_factor=0.5), "partial_rotary_factor"),
    "no_rope_theta_4x": (_without("rope_theta"), "rope_theta"),
    "no_rope_theta_5x": (_5x({"rope_type": "default"}), "rope_theta"),
    "conflicting_rope_theta": (_with(rope_parameters={"rope_type": "default", "rope_theta": 1e4}), "rope_theta"),
    "rope_theta_not_a_number": (_with(rope_theta="1e6"), "rope_theta"),
    "no_head_dim": (_without("head_dim"), "head_dim"),
    "no_hidden_size": (_without("hidden_size"), "hidden_size"),
    "sliding_window": (_with(use_sliding_window=True, sliding_window=4096), "use_sliding_window"),
    "layer_types": (_with(layer_types=["full_attention", "sliding_attention"]), "layer_types"),
    "attention_bias": (_with(attention_bias=True), "attention_bias"),
    "attention_dropout": (_with(attention_dropout=0.1), "attention_dropout"),
    "not_causal": (_with(is_causal=False), "is_causal"),
    "moe_num_experts": (_with(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, decoder_sparse_step=1),
                        "num_experts"),
    "moe_intermediate_size": (_with(moe_intermediate_size=64), "moe_intermediate_size"),
    "quantized": (_with(quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]}),
                  "quantization_config"),
    "compressed_tensors": (_with(compression_config={"format": "pack-quantized"}), "compression_config"),
    "dual_chunk_attention": (_with(dual_chunk_attention_config={"chunk_size": 8192}), "dual_chunk_attention_config"),
    "gelu": (_with(hidden_act="gelu"), "hidden_act"),
    "qwen3_moe": (_with(model_type="qwen3_moe"), "model_type"),
    "llama": (_with(model_type="llama"), "model_type"),
    "classifier": (_with(architectures=["Qwen3ForSequenceClassification"]), "architectures"),
    "kv_heads_default_32": (_without("num_key_value_heads"), "num_key_value_heads"),
    "wrong_type": (_with(num_hidden_layers="2"), "num_hidden_layers"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_unsupported_config_is_refused_in_one_line(case):
    edit, field = REFUSED[case]
    with pytest.raises(ConfigError) as e:
        model_args_from_hf_config(edit(hf_config_for_shape("tiny")))
    msg = str(e.value)
    assert field in msg and "\n" not in msg and len(msg) < 300, msg


def test_refusal_reaches_the_cli_as_one_line(tiny_ckpt, tmp_path, capsys):
    yarn = rewrite_config(tiny_ckpt, tmp_path / "yarn", REFUSED["yarn_4x"][0])
    with pytest.raises(WeightsError, match='rope_scaling.rope_type="yarn"' ):
        load_hf_checkpoint(yarn)
    assert weights.main(["--check", str(yarn)]) == 1
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "rope_scaling" in err, err


def test_hf_quant_config_json_is_refused(tiny_ckpt, tmp_path):
    quant = rewrite_config(tiny_ckpt, tmp_path / "quant", lambda c: c)
    (quant / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "FP8"}}))
    with pytest.raises(WeightsError, match="hf_quant_config.json"):
        load_hf_checkpoint(quant)


# Qwen/Qwen3-4B, -8B, -14B and -32B as their model cards give them: (parameters, non-embedding parameters)
REAL_SIZES = {"Qwen3-4B": (4.0e9, 3.6e9), "Qwen3-8B": (8.2e9, 6.95e9), "Qwen3-14B": (14.8e9, 13.2e9),
              "Qwen3-32B": (32.8e9, 31.2e9)}


@pytest.mark.parametrize("shape", list(REAL_SIZES))
def test_real_shapes_have_the_published_sizes(shape):
    args = model_args_from_hf_config(hf_config_for_shape(shape))
    shapes = weights.expected_hf_shapes(args)
    total = sum(torch.Size(s).numel() for s in shapes.values())
    embedding = sum(torch.Size(s).numel() for k, s in shapes.items() if k in ("model.embed_tokens.weight",
                                                                              "lm_head.weight"))
    expected_total, expected_body = REAL_SIZES[shape]
    assert abs(total - expected_total) < 0.05e9 and abs(total - embedding - expected_body) < 0.05e9
    assert (args.rope_theta, args.norm_eps, args.max_seq_len, args.vocab_size) == (1e6, 1e-6, 40960, 151936)
    assert shape in weights._parser().parse_args(["--random", shape, "--out", "x"]).random and shape in SHAPES
