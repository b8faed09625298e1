"""weights.py CLI: bad input gives exactly one line on stderr that names the problem, and a non-zero exit.

Each subprocess pays ~7 s of imports (torch + torchtitan), so the subprocess cases are started
together once and their results shared; further cases call `weights.main` in-process.
"""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

import weights

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _broken_checkpoint(src, dst, edit):
    """Copy of checkpoint `src` whose state dict has been changed by `edit(sd)`."""
    dst.mkdir()
    (dst / "config.json").write_bytes((src / "config.json").read_bytes())
    sd = load_file(str(src / "model.safetensors"))
    edit(sd)
    save_file(sd, str(dst / "model.safetensors"))
    return dst


def _drop_norm(sd):
    del sd["model.layers.1.post_attention_layernorm.weight"]


def _shrink_q_proj(sd):
    sd["model.layers.0.self_attn.q_proj.weight"] = sd["model.layers.0.self_attn.q_proj.weight"][:8].clone()


@pytest.fixture(scope="module")
def cli_runs(tiny_ckpt, module_dir):
    """case -> (expected stderr fragment, expected status, exit code, stdout, stderr) of `python weights.py ...`."""
    tmp = module_dir
    llama = tmp / "llama"
    llama.mkdir()
    cfg = json.loads((tiny_ckpt / "config.json").read_text())
    (llama / "config.json").write_text(json.dumps({**cfg, "model_type": "llama"}))
    cases = {
        "missing_dir": (["--check", str(tmp / "nope")], "does not exist", 1),
        "non_qwen3_config": (["--check", str(llama)], "model_type='llama'", 1),
        "missing_tensor": (["--check", str(_broken_checkpoint(tiny_ckpt, tmp / "missing", _drop_norm))],
                           "missing 1 tensor(s): model.layers.1.post_attention_layernorm.weight", 1),
        "wrong_shape": (["--check", str(_broken_checkpoint(tiny_ckpt, tmp / "shape", _shrink_q_proj))],
                        "model.layers.0.self_attn.q_proj.weight has shape [8, 128]", 1),
        "unknown_random_shape": (["--random", "Qwen3-999B", "--out", str(tmp / "x")],
                                 "invalid choice: 'Qwen3-999B'", 2),
        "out_under_a_file": (["--random", "tiny", "--layers", "1", "--out", str(tmp / "x" / "ck")],
                             "cannot read or write", 6),
    }
    (tmp / "x").write_text("a file, not a directory")
    # Start every process first, then wait: they run in parallel.
    procs = {name: subprocess.Popen([sys.executable, "weights.py", *argv], cwd=REPO_ROOT, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for name, (argv, _, _) in cases.items()}
    results = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        results[name] = (cases[name][1], cases[name][2], proc.returncode, out, err)
    return results


@pytest.mark.parametrize("case", ["missing_dir", "non_qwen3_config", "missing_tensor", "wrong_shape",
                                  "unknown_random_shape", "out_under_a_file"])
def test_bad_input_is_one_line_on_stderr(cli_runs, case):
    fragment, status, rc, out, err = cli_runs[case]
    assert rc == status, (rc, err)
    assert len(err.splitlines()) == 1, err
    assert "Traceback" not in err and fragment in err, err


def test_check_prints_a_summary(tiny_ckpt, capsys):
    assert weights.main(["--check", str(tiny_ckpt)]) == 0
    out = capsys.readouterr().out
    assert "Qwen3, 2 layers, hidden 128" in out and "untied embeddings" in out and out.strip().endswith("OK")


@pytest.mark.parametrize("argv, fragment", [
    (["--random", "tiny", "--layers", "0", "--out", "{tmp}/zero"], "num_layers must be >= 1"),
    (["--random", "tiny", "--out", "{tmp}/full"], "already exists and is not empty"),
    (["--random", "tiny"], "--out DIR is required"),
    ([], "one of the arguments --random --download --check --merge-lora is required"),
    (["--download", "spirl-test/no-such-repo", "--out", "{tmp}/dl"], "could not download"),
    (["--check", "{tiny}", "--dtype", "fp64"], "invalid choice: 'fp64'"),
])
def test_more_bad_input_in_process(argv, fragment, tmp_path, tiny_ckpt, capsys, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # never touch the network
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("x")
    argv = [a.format(tmp=tmp_path, tiny=tiny_ckpt) for a in argv]
    try:
        rc = weights.main(argv)
    except SystemExit as e:  # argparse errors exit directly
        rc = e.code
    err = capsys.readouterr().err
    assert rc != 0
    assert len(err.splitlines()) == 1 and fragment in err, err


def test_random_cli_writes_a_checkpoint(tmp_path, capsys):
    assert weights.main(["--random", "tiny", "--layers", "1", "--dtype", "fp32", "--seed", "3",
                         "--out", str(tmp_path / "ck")]) == 0
    assert "Qwen3, 1 layers" in capsys.readouterr().out
    cfg, sd = weights.load_hf_checkpoint(tmp_path / "ck")
    assert cfg["num_hidden_layers"] == 1 and sd["model.norm.weight"].dtype == torch.float32


def test_transformers_notices_go_to_stdout_not_stderr(capsys):
    """Some transformers versions print a notice on stderr when loading any local tokenizer (seen on
    the GPU host: "...with an incorrect regex pattern..."), which made a one-line error two lines.
    After log_to_stdout(), transformers' logger propagates to the stdout handler instead."""
    import logging

    from transformers.utils import logging as hf_logging

    from spirl.core.errors import log_to_stdout

    root = logging.getLogger()
    saved = root.handlers[:]
    root.handlers = []
    try:
        log_to_stdout()
        hf_logging.get_logger("transformers.tokenization_utils_tokenizers").warning("tokenizer notice")
        out, err = capsys.readouterr()
    finally:
        root.handlers = saved
        hf_logging.enable_default_handler()
        hf_logging.disable_propagation()
    assert "tokenizer notice" in out and "tokenizer notice" not in err
