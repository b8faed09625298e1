"""HF <-> TorchTitan <-> vLLM-compat conversions, checkpoint validation, random checkpoints."""

import hashlib
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import weights
from torchtitan_compat.config import model_args_from_hf_config
from weights import WeightsError, hf_to_titan, load_hf_checkpoint, titan_to_hf, write_random_checkpoint
from weights_vllm_compat import (
    compat_to_hf,
    compat_to_titan,
    compat_to_vllm_weights,
    expected_compat_shapes,
    hf_to_compat,
    titan_to_compat,
)

CKPTS = ["tiny_ckpt", "qwen06_2layer_ckpt"]


@pytest.fixture(scope="module", params=CKPTS)
def ckpt(request):
    """(model_dir, config dict, HF state dict, model args) of each session checkpoint."""
    model_dir = request.getfixturevalue(request.param)
    cfg, sd = load_hf_checkpoint(model_dir)
    return model_dir, cfg, sd, model_args_from_hf_config(cfg)


def assert_same_tensors(a: dict, b: dict):
    assert set(a) == set(b), f"key sets differ: {set(a) ^ set(b)}"
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def test_checkpoint_matches_its_config(ckpt):
    model_dir, cfg, sd, args = ckpt
    assert cfg["model_type"] == "qwen3" and cfg["torch_dtype"] == "float32"
    assert {k: tuple(v.shape) for k, v in sd.items()} == weights.expected_hf_shapes(args)
    assert ("lm_head.weight" in sd) == (not args.enable_weight_tying)
    assert all(t.dtype == torch.float32 for t in sd.values())
    assert (model_dir / "tokenizer.json").is_file() and (model_dir / "generation_config.json").is_file()


def test_expected_titan_names_match_the_torchtitan_model(ckpt):
    from torchtitan.models.qwen3 import Qwen3Model

    *_, args = ckpt
    with torch.device("meta"):
        model = Qwen3Model(args)
    real = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert real == weights.expected_titan_shapes(args)
    model.load_state_dict(hf_to_titan(ckpt[2], args), strict=True, assign=True)  # loads as-is


def test_converted_weights_give_transformers_logits(tiny_ckpt):
    """The checkpoint is real HF format and hf_to_titan maps it right: TorchTitan's Qwen3 on the
    converted weights computes the logits of transformers' Qwen3 on the original files."""
    from torchtitan.models.qwen3 import Qwen3Model
    from transformers import AutoModelForCausalLM

    cfg, sd = load_hf_checkpoint(tiny_ckpt)
    args = model_args_from_hf_config(cfg)
    hf_model = AutoModelForCausalLM.from_pretrained(str(tiny_ckpt), dtype=torch.float32).eval()
    titan_model = Qwen3Model(args).eval()
    titan_model.load_state_dict(hf_to_titan(sd, args), strict=True)
    ids = torch.randint(0, 151643, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(titan_model(ids), hf_model(ids).logits)


def test_round_trip_hf_titan_compat_is_bit_exact(ckpt):
    *_, sd, args = ckpt
    titan = hf_to_titan(sd, args)
    compat = titan_to_compat(titan, args)
    titan2 = compat_to_titan(compat, args)
    hf2 = titan_to_hf(titan2, args)
    assert_same_tensors(titan, titan2)
    assert_same_tensors(sd, hf2)
    assert set(compat) == set(expected_compat_shapes(args))
    assert_same_tensors(compat, hf_to_compat(hf2, args))
    assert_same_tensors(sd, compat_to_hf(compat, args, clone=True))
    if args.enable_weight_tying:  # Titan carries the head as the embedding; compat and HF omit it
        assert torch.equal(titan["output.weight"], titan["tok_embeddings.weight"])
        assert "output.weight" not in compat and "lm_head.weight" not in hf2
    else:
        assert torch.equal(compat["output.weight"], sd["lm_head.weight"])


def test_fused_weights_are_concatenations(ckpt):
    *_, sd, args = ckpt
    compat = hf_to_compat(sd, args)
    p = "model.layers.1."
    assert torch.equal(compat["layers.1.attention.qkv_proj.weight"], torch.cat(
        [sd[p + "self_attn.q_proj.weight"], sd[p + "self_attn.k_proj.weight"], sd[p + "self_attn.v_proj.weight"]]))
    assert torch.equal(compat["layers.1.feed_forward.gate_up_proj.weight"],
                       torch.cat([sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]]))
    assert torch.equal(compat["layers.1.attention.o_proj.weight"], sd[p + "self_attn.o_proj.weight"])
    assert torch.equal(compat["layers.1.feed_forward.down_proj.weight"], sd[p + "mlp.down_proj.weight"])


def test_vllm_weights_have_hf_names_and_shapes(ckpt):
    *_, sd, args = ckpt
    pairs = list(compat_to_vllm_weights(hf_to_compat(sd, args), args))
    names = [n for n, _ in pairs]
    assert len(names) == len(set(names)) and set(names) == set(sd)
    for name, t in pairs:
        assert t.shape == sd[name].shape and torch.equal(t, sd[name]), name


def test_hf_to_titan_leaves_its_input_alone(ckpt):
    *_, sd, args = ckpt
    before = dict(sd)
    hf_to_titan(sd, args)
    assert list(sd) == list(before) and all(sd[k] is before[k] for k in sd)


def test_conversions_reject_wrong_inputs(ckpt):
    *_, sd, args = ckpt
    with pytest.raises(WeightsError, match="missing 1 tensor.*model.norm.weight"):
        hf_to_titan({k: v for k, v in sd.items() if k != "model.norm.weight"}, args)
    with pytest.raises(WeightsError, match="unexpected tensor.*model.extra.weight"):
        hf_to_titan({**sd, "model.extra.weight": torch.zeros(1)}, args)
    bad = dict(sd)
    bad["model.layers.0.mlp.up_proj.weight"] = bad["model.layers.0.mlp.up_proj.weight"][:-1]
    with pytest.raises(WeightsError, match="up_proj.weight has shape"):
        hf_to_titan(bad, args)
    titan = hf_to_titan(sd, args)
    # torchtitan's adapter would silently drop an unknown name; we refuse it
    with pytest.raises(WeightsError, match="unexpected tensor.*layers.0.attention.extra"):
        titan_to_hf({**titan, "layers.0.attention.extra": torch.zeros(1)}, args)
    compat = titan_to_compat(titan, args)
    with pytest.raises(WeightsError, match="compat state dict"):
        compat_to_titan({k: v for k, v in compat.items() if k != "norm.weight"}, args)
    if args.enable_weight_tying:
        with pytest.raises(WeightsError, match="unexpected tensor.*output.weight"):
            compat_to_titan({**compat, "output.weight": compat["tok_embeddings.weight"]}, args)
        with pytest.raises(WeightsError, match="differs from"):
            hf_to_titan({**sd, "lm_head.weight": sd["model.embed_tokens.weight"] + 1}, args)
        # a tied checkpoint that stores an identical head anyway is accepted
        assert_same_tensors(hf_to_titan({**sd, "lm_head.weight": sd["model.embed_tokens.weight"].clone()}, args), titan)


def test_random_weights_look_like_an_initialized_model(tiny_ckpt):
    _, sd = load_hf_checkpoint(tiny_ckpt)
    norm = sd["model.layers.0.input_layernorm.weight"]
    assert abs(norm.mean().item() - 1) < 0.05 and 0.05 < norm.std().item() < 0.15
    assert abs(sd["model.embed_tokens.weight"].std().item() - 0.02) < 0.001


def _file_digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_random_checkpoint_is_deterministic(tiny_ckpt, tmp_path):
    again = write_random_checkpoint(tmp_path / "again", "tiny", seed=0, dtype=torch.float32)
    assert _file_digest(again / "model.safetensors") == _file_digest(tiny_ckpt / "model.safetensors")
    assert_same_tensors(load_hf_checkpoint(again)[1], load_hf_checkpoint(tiny_ckpt)[1])
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (again / name).read_bytes() == (tiny_ckpt / name).read_bytes(), name
    other = load_hf_checkpoint(write_random_checkpoint(tmp_path / "seed1", "tiny", seed=1, dtype=torch.float32))[1]
    assert not any(torch.equal(other[k], v) for k, v in load_hf_checkpoint(tiny_ckpt)[1].items())


def test_bf16_checkpoint_is_the_fp32_one_rounded(tiny_ckpt, tmp_path):
    bf16_dir = write_random_checkpoint(tmp_path / "bf16", "tiny", seed=0)  # default dtype: bfloat16
    cfg, sd = load_hf_checkpoint(bf16_dir)
    assert cfg["torch_dtype"] == "bfloat16"
    fp32 = load_hf_checkpoint(tiny_ckpt)[1]
    assert_same_tensors(sd, {k: v.to(torch.bfloat16) for k, v in fp32.items()})


def test_sharded_checkpoint_loads_like_a_single_file(tiny_ckpt, tmp_path):
    sd = load_file(str(tiny_ckpt / "model.safetensors"))
    names = sorted(sd)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for fname, keys in shards.items():
        save_file({k: sd[k] for k in keys}, str(tmp_path / fname))
    index = {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    (tmp_path / "config.json").write_bytes((tiny_ckpt / "config.json").read_bytes())
    assert_same_tensors(load_hf_checkpoint(tmp_path)[1], sd)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(WeightsError, match="model-00002-of-00002.safetensors.*missing"):
        load_hf_checkpoint(tmp_path)


def test_resolve_model_dir(tiny_ckpt, monkeypatch):
    assert weights.resolve_model_dir(str(tiny_ckpt)) == tiny_ckpt
    with pytest.raises(WeightsError, match="does not exist"):
        weights.resolve_model_dir("./no/such/dir")
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(WeightsError, match="could not download 'spirl-test/no-such-repo'"):
        weights.resolve_model_dir("spirl-test/no-such-repo")
