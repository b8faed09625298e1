"""The user's error path, run like a user runs it: each case is a subprocess of simple_rl.py,
run_comparison.sh or a compare/ CLI, and must end with its exit status (spirl/core/errors.py), exactly
one non-empty stderr line matching the expected message, no traceback, and nothing lost (the
previous checkpoint and the logs intact where a run had written them).

Each subprocess pays ~6 s of imports, so every case is started at once in one module fixture and
the results are shared. Failures a CPU machine cannot produce are simulated from outside the
product code: a fake `vllm` package on PYTHONPATH (missing, wrong version, right version),
CUDA_VISIBLE_DEVICES="" (no GPU even on a GPU box), an unreachable HF_ENDPOINT (no network), and
small wrapper scripts that patch a library function before running the entry point (a full disk:
the checkpoint's safetensors writer raises ENOSPC; a small GPU: torch.cuda reports a 3 GiB device).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from spirl.core import checkpoint as ckpt
from spirl.core import errors

REPO = Path(__file__).resolve().parents[1]
ONE_STEP = ["--engine", "native", "--dtype", "float32", "--task", "synthetic", "--steps", "1",
            "--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "4"]


@dataclass
class Case:
    argv: list[str]
    code: int
    pattern: str
    """A regex the one stderr line must match (re.search)."""
    env: dict = field(default_factory=dict)
    patch: str | None = None
    """Name of a patch file (written by the fixture) the wrapper runs before the entry point."""
    traceback: bool = False
    """True for the cases where a traceback is expected (a bug, or debugging on)."""


# -- helpers the fixture writes ---------------------------------------------------------------------

WRAPPER = '''
import runpy, sys
patch, script = sys.argv[1], sys.argv[2]
exec(compile(open(patch).read(), patch, "exec"))
sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.abspath(script)))
sys.argv = sys.argv[2:]
runpy.run_path(script, run_name="__main__")
'''

PATCHES = {
    # a disk that fills while step 2's checkpoint is written (steps 1's three files are written)
    "enospc": '''
import errno
import torchtitan_compat.safetensors_io as st
_real, _calls = st.write_safetensors, [0]
def _write(path, *a, **kw):
    _calls[0] += 1
    if _calls[0] >= 4:
        raise OSError(errno.ENOSPC, "No space left on device", str(path))
    return _real(path, *a, **kw)
st.write_safetensors = _write
''',
    # a 3 GiB GPU, as torch.cuda would report it (nothing reaches CUDA: the plan refuses first)
    "small_gpu": '''
import types, torch
torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: 1
torch.cuda.get_device_properties = lambda d=None: types.SimpleNamespace(total_memory=3 * 2**30, name="Fake GPU")
''',
    # the engine's logprob of one sampled token is one ulp off: parity breaks at step 1
    "parity_flip": '''
import torch
from spirl.core import policy
_real = policy.build_engine
def _build(cfg, model_dir, policy):
    engine = _real(cfg, model_dir, policy)
    generate = engine.generate
    def generate_then_flip(*a, **kw):
        samples = generate(*a, **kw)
        samples[1].logprobs[0] = torch.nextafter(samples[1].logprobs[0], torch.tensor(0.0))
        return samples
    engine.generate = generate_then_flip
    return engine
policy.build_engine = _build
''',
    "nan_loss": '''
from spirl.loops import update
_real = update.grpo_loss
def _nan(*a, **kw):
    loss, m = _real(*a, **kw)
    return loss * float("nan"), m
update.grpo_loss = _nan
''',
    # a bug: not an expected error, so a traceback and status 70
    "bug": '''
from spirl.loops import trainer
def _run_step(*a, **kw):
    return {}["no such key"]
trainer.run_step = _run_step
''',
    # a task whose prompts are not known up front (no `pool`): checked per generate call
    "nopool_task": '''
from spirl import tasks
from spirl.tasks.synthetic import SyntheticTask
class NoPool:
    name = "nopool"
    def __init__(self, tokenizer):
        self._inner = SyntheticTask(tokenizer)
    def prompts(self, rng, n):
        return [(ids * 3, meta) for ids, meta in self._inner.prompts(rng, n)]
    def reward(self, completion_ids, meta):
        return 0.0
tasks.register("nopool", NoPool)
''',
}

FAKE_VLLM = {
    "missing": 'raise ModuleNotFoundError("No module named \'vllm\'", name="vllm")\n',
    "old": '__version__ = "0.10.1"\n',
    "pinned": f'__version__ = "{errors.pinned_vllm_version()}"\n',
}


def _link_copy(src: Path, dst: Path) -> Path:
    """A copy of a checkpoint made of hard links (files are replaced, never edited in place)."""
    shutil.copytree(src, dst, copy_function=os.link)
    return dst


def _replace(path: Path, data: bytes) -> None:
    path.unlink()
    path.write_bytes(data)


def bad_dirs(tiny: Path, root: Path) -> dict[str, Path]:
    """The six bad checkpoint directories of issue 14, and one more (.bin with a config)."""
    out = {}
    d = out["llama"] = _link_copy(tiny, root / "llama")
    _replace(d / "config.json", json.dumps({**json.loads((tiny / "config.json").read_text()),
                                            "model_type": "llama"}).encode())
    d = out["truncated"] = _link_copy(tiny, root / "truncated")
    blob = (tiny / "model.safetensors").read_bytes()
    _replace(d / "model.safetensors", blob[:len(blob) // 2])
    d = out["renamed"] = _link_copy(tiny, root / "renamed")
    sd = load_file(str(tiny / "model.safetensors"))
    sd["model.layers.0.mlp.gate.weight"] = sd.pop("model.layers.0.mlp.gate_proj.weight")
    (d / "model.safetensors").unlink()
    save_file(sd, str(d / "model.safetensors"))
    out["empty"] = root / "empty"
    out["empty"].mkdir()
    out["bin_only"] = root / "bin_only"
    out["bin_only"].mkdir()
    (out["bin_only"] / "pytorch_model.bin").write_bytes(b"\0" * 64)
    d = out["bin_with_config"] = root / "bin_with_config"
    d.mkdir()
    shutil.copy(tiny / "config.json", d / "config.json")
    (d / "pytorch_model.bin").write_bytes(b"\0" * 64)
    d = out["not_json"] = _link_copy(tiny, root / "not_json")
    _replace(d / "config.json", b'{"model_type": "qwen3",')
    return out


def fake_checkpoints(tiny: Path, root: Path) -> dict[str, Path]:
    """--resume inputs: corrupt ones, one from another model, one from another reference model."""
    from spirl.core.preflight import model_fingerprint, validate_model_dir
    from weights_vllm_compat import expected_compat_shapes

    _, args = validate_model_dir(tiny)
    shapes = expected_compat_shapes(args)

    def write(name, shapes, reference):
        masters = {k: torch.zeros(s) for k, s in shapes.items()}
        opt = torch.optim.AdamW(list(masters.values()))
        return ckpt.save(root / name, 1, masters, opt, {"reference": reference})

    same = {"model": str(tiny), "model_dir": str(tiny), "fingerprint": model_fingerprint(tiny)}
    other = {**same, "model": "/elsewhere/qwen3-tuned", "model_dir": "/elsewhere/qwen3-tuned",
             "fingerprint": "0123456789abcdef"}
    out = {"other_reference": write("other_reference", shapes, other)}
    small_vocab = {k: ((1000,) + tuple(s[1:]) if k in ("tok_embeddings.weight", "output.weight") else s)
                   for k, s in shapes.items()}
    out["other_model"] = write("other_model", small_vocab, {**same, "model": "/elsewhere/small-vocab"})
    truncated = write("truncated", small_vocab, same)
    blob = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(blob[:len(blob) // 3])
    out["truncated"] = truncated
    not_json = write("not_json", small_vocab, same)
    (not_json / "state.json").write_text("{\"step\": 1,")
    out["state_not_json"] = not_json
    dangling = root / "dangling"
    dangling.mkdir()
    (dangling / "latest").write_text("step_000007\n")
    out["dangling_latest"] = dangling
    return out


# -- the cases ------------------------------------------------------------------------------------------

SIMPLE = ["bad_llama", "bad_truncated", "bad_renamed", "bad_empty", "bad_bin_only", "bad_bin_with_config",
          "bad_not_json", "missing_dir", "download_failure", "vllm_batch_invariant_unset", "vllm_missing",
          "vllm_wrong_version", "vllm_no_cuda", "device_cuda_without_gpu", "prompt_too_long",
          "prompt_too_long_at_generate", "out_dir_not_writable", "checkpoint_dir_not_writable", "gpu_too_small",
          "disk_full", "resume_truncated", "resume_state_not_json", "resume_dangling_latest", "resume_missing",
          "resume_other_model", "resume_other_reference", "parity_broken", "loss_nan", "bug_has_traceback",
          "debug_env_traceback", "debug_flag_traceback", "bad_flag",
          "compare_no_network", "compare_vllm_missing", "compare_bad_checkpoint", "compare_no_cuda",
          "compare_bad_args", "compare_no_prompt", "filter_bad_builtin", "filter_missing_file",
          "oversample_without_filter"]
INTERRUPTS = ["sigint", "sigterm"]


def build_cases(tiny: Path, tmp: Path) -> dict[str, Case]:
    bad = bad_dirs(tiny, tmp / "bad")
    resume = fake_checkpoints(tiny, tmp / "resume")
    vllm = {}
    for kind, src in FAKE_VLLM.items():
        (tmp / "vllm" / kind / "vllm").mkdir(parents=True)
        (tmp / "vllm" / kind / "vllm" / "__init__.py").write_text(src)
        vllm[kind] = {"PYTHONPATH": str(tmp / "vllm" / kind)}
    (tmp / "a_file").write_text("not a directory\n")
    offline = {"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HOME": str(tmp / "hf")}
    bi = {"VLLM_BATCH_INVARIANT": "1"}
    model = ["--model", str(tiny)]
    c: dict[str, Case] = {}
    shape = r"the weights do not match config\.json"
    c["bad_llama"] = Case(["--model", str(bad["llama"])] + ONE_STEP, 3,
                           r"model_type='llama'; only 'qwen3' \(dense\) and 'qwen3_moe' are supported")
    c["bad_truncated"] = Case(["--model", str(bad["truncated"])] + ONE_STEP, 3,
                              r"model\.safetensors is not a readable safetensors file .*re-download")
    c["bad_renamed"] = Case(["--model", str(bad["renamed"])] + ONE_STEP, 3,
                            r"missing 1 tensor\(s\): model\.layers\.0\.mlp\.gate_proj\.weight; " + shape)
    c["bad_empty"] = Case(["--model", str(bad["empty"])] + ONE_STEP, 3,
                          r"is not a checkpoint: config\.json is missing \(it is empty\)")
    c["bad_bin_only"] = Case(["--model", str(bad["bin_only"])] + ONE_STEP, 3,
                             r"config\.json is missing \(it holds only pytorch_model\.bin\)")
    c["bad_bin_with_config"] = Case(["--model", str(bad["bin_with_config"])] + ONE_STEP, 3,
                                    r"only PyTorch \.bin/\.pt weights; only safetensors are supported")
    c["bad_not_json"] = Case(["--model", str(bad["not_json"])] + ONE_STEP, 3, r"config\.json is not valid JSON")
    c["missing_dir"] = Case(["--model", str(tmp / "nope")] + ONE_STEP, 3, r"does not exist")
    c["download_failure"] = Case(["--model", "Qwen/Qwen3-0.6B"] + ONE_STEP, 3,
                                 r"could not download 'Qwen/Qwen3-0\.6B' from the Hugging Face Hub", offline)
    c["vllm_batch_invariant_unset"] = Case(model, 4, r"VLLM_BATCH_INVARIANT=1 is not set.*--engine native",
                                           vllm["pinned"])
    c["vllm_missing"] = Case(model, 4, r"vLLM is not installed: pip install vllm==0\.26\.0", {**vllm["missing"], **bi})
    c["vllm_wrong_version"] = Case(model, 4, r"vLLM 0\.10\.1 is installed.*pip install vllm==0\.26\.0",
                                   {**vllm["old"], **bi})
    c["vllm_no_cuda"] = Case(model, 4, r"--engine vllm needs a CUDA GPU", {**vllm["pinned"], **bi})
    c["device_cuda_without_gpu"] = Case(model + ONE_STEP + ["--device", "cuda"], 4,
                                        r"--device cuda: torch sees no CUDA GPU")
    c["prompt_too_long"] = Case(model + ONE_STEP + ["--max-model-len", "40", "--max-new-tokens", "30"], 2,
                                r"longest prompt of --task synthetic has 20 tokens; .* 50 > 40 \(--max-model-len\): "
                                r"lower --max-new-tokens to 20")
    c["prompt_too_long_at_generate"] = Case(
        model + ONE_STEP + ["--task", "nopool", "--max-model-len", "64", "--max-new-tokens", "8"], 2,
        r"a prompt of this step has \d+ tokens; with --max-new-tokens 8 that is \d+ > 64 \(--max-model-len\)",
        patch="nopool_task")
    c["out_dir_not_writable"] = Case(model + ONE_STEP + ["--out-dir", str(tmp / "a_file" / "runs")], 6,
                                     r"--out-dir: cannot create .*a_file/runs/grpo: .*a_file exists and is not a "
                                     r"directory")
    c["checkpoint_dir_not_writable"] = Case(model + ONE_STEP + ["--checkpoint-dir", str(tmp / "a_file")], 6,
                                            r"--checkpoint-dir: cannot create .*a_file/grpo")
    c["gpu_too_small"] = Case(model + ONE_STEP + ["--device", "cuda", "--prompts-per-step", "64", "--group-size", "8",
                                                  "--max-new-tokens", "200"], 5,
                              r"needs about [\d.]+ GiB of GPU memory but cuda \(Fake GPU\) has 3\.0 GiB .*"
                              r"lower --max-tokens-per-microbatch to \d+", patch="small_gpu")
    c["disk_full"] = Case(model + ONE_STEP + ["--steps", "2", "--checkpoint-every", "1"], 6,
                          r"could not write checkpoint .*step_000002 \(No space left on device.*\); nothing of it "
                          r"was kept, the previous checkpoint .*step_000001 is intact; free disk space .*--resume ",
                          patch="enospc")
    c["resume_truncated"] = Case(model + ONE_STEP + ["--resume", str(resume["truncated"])], 3,
                                 r"checkpoint .*step_000001 is unusable: model\.safetensors is not a readable "
                                 r"safetensors")
    c["resume_state_not_json"] = Case(model + ONE_STEP + ["--resume", str(resume["state_not_json"])], 3,
                                      r"is unusable: state\.json is not valid JSON")
    c["resume_dangling_latest"] = Case(model + ONE_STEP + ["--resume", str(resume["dangling_latest"])], 3,
                                       r"latest names 'step_000007', which is not a complete checkpoint")
    c["filter_bad_builtin"] = Case(model + ONE_STEP + ["--filter", "min_reward:high"], 2,
                                   r"--filter 'min_reward:high': 'high' is not a number")
    c["filter_missing_file"] = Case(model + ONE_STEP + ["--filter", str(tmp / "nope.py") + ":keep"], 2,
                                    r"--filter .*nope\.py:keep': there is no file")
    c["oversample_without_filter"] = Case(model + ONE_STEP + ["--oversample", "2"], 2,
                                          r"--oversample needs --filter or --dynamic-sampling 1")
    c["resume_missing"] = Case(model + ONE_STEP + ["--resume", str(tmp / "no_ckpt")], 3, r"no checkpoint at ")
    c["resume_other_model"] = Case(model + ONE_STEP + ["--resume", str(resume["other_model"])], 3,
                                   r"was written for another model \(tok_embeddings\.weight is \[1000, 128\] there but "
                                   r"\[151936, 128\].*resume with the --model that run used \(/elsewhere/small-vocab\)")
    c["resume_other_reference"] = Case(model + ONE_STEP + ["--resume", str(resume["other_reference"])], 3,
                                       r"that run started from --model /elsewhere/qwen3-tuned .* the reference policy "
                                       r"would change; resume with --model /elsewhere/qwen3-tuned")
    c["parity_broken"] = Case(model + ONE_STEP, 7, r"parity broken at step 1: .*different: 1.*report: .*"
                                                   r"parity_failure_step000001\.json", patch="parity_flip")
    c["loss_nan"] = Case(model + ONE_STEP + ["--group-size", "4", "--max-new-tokens", "6"], 8,
                         r"training diverged: loss is nan.*--max-grad-norm",
                         patch="nan_loss")
    c["bug_has_traceback"] = Case(model + ONE_STEP, 70, r"internal error \(a bug\): KeyError: .*report it",
                                  patch="bug", traceback=True)
    c["debug_env_traceback"] = Case(["--model", str(bad["empty"])] + ONE_STEP, 3, r"config\.json is missing",
                                    {"SPIRL_DEBUG": "1"}, traceback=True)
    c["debug_flag_traceback"] = Case(["--model", str(bad["renamed"]), "--debug", "1"] + ONE_STEP, 3,
                                     r"missing 1 tensor", traceback=True)
    c["bad_flag"] = Case(model + ONE_STEP + ["--group-size", "1"], 2, r"group_size must be >= 2")
    # ./run_comparison.sh (compare/direct_forward.py); it sets VLLM_BATCH_INVARIANT=1 itself
    rc = ["bash", str(REPO / "run_comparison.sh")]
    c["compare_no_network"] = Case(rc + ["hi"], 3, r"could not download 'Qwen/Qwen3-1\.7B'",
                                   {**offline, **vllm["pinned"]})
    c["compare_vllm_missing"] = Case(rc + ["--model", str(tiny), "hi"], 4, r"vLLM is not installed", vllm["missing"])
    c["compare_bad_checkpoint"] = Case(rc + ["--model", str(bad["truncated"]), "hi"], 3,
                                       r"not a readable safetensors file", vllm["pinned"])
    c["compare_no_cuda"] = Case(rc + ["--model", str(tiny), "hi"], 4, r"the parity check .* needs a CUDA GPU",
                                vllm["pinned"])
    c["compare_bad_args"] = Case(rc + ["--samples", "0", "hi"], 2, r"--samples must be >= 1")
    c["compare_no_prompt"] = Case(rc + ["--model", str(tiny)], 2, r"error: no prompt given")
    return c


def _env(tmp: Path, extra: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_BATCH_INVARIANT", "SPIRL_DEBUG", "PYTHONPATH")}
    env.update(HF_HUB_OFFLINE="1", CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def _command(case: Case, tmp: Path, name: str) -> list[str]:
    if case.argv[0] == "bash":
        return case.argv
    dirs = []
    if "--checkpoint-dir" not in case.argv:
        dirs += ["--checkpoint-dir", str(tmp / "runs" / name / "ckpt")]
    if "--out-dir" not in case.argv:
        dirs += ["--out-dir", str(tmp / "runs" / name / "logs")]
    script = [str(tmp / "wrapper.py"), str(tmp / f"{case.patch}.py")] if case.patch else []
    return [sys.executable, *script, str(REPO / "simple_rl.py"), *case.argv, *dirs]


def _interrupt_run(tiny: Path, tmp: Path, name: str) -> list[str]:
    return [sys.executable, str(REPO / "simple_rl.py"), "--model", str(tiny), *ONE_STEP, "--steps", "50",
            "--checkpoint-every", "1", "--checkpoint-dir", str(tmp / "runs" / name / "ckpt"),
            "--out-dir", str(tmp / "runs" / name / "logs")]


@pytest.fixture(scope="module")
def matrix(tiny_ckpt, module_dir):
    """name -> (case, returncode, stdout, stderr, seconds); interrupt cases also get their resume run."""
    tmp = module_dir
    (tmp / "wrapper.py").write_text(WRAPPER)
    for name, src in PATCHES.items():
        (tmp / f"{name}.py").write_text(textwrap.dedent(src))
    cases = build_cases(tiny_ckpt, tmp)
    t0 = time.perf_counter()
    procs = {}
    for name in INTERRUPTS:  # first: they run longest
        procs[name] = subprocess.Popen(_interrupt_run(tiny_ckpt, tmp, name), cwd=tmp, env=_env(tmp, {}), text=True,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    for name, case in cases.items():
        procs[name] = subprocess.Popen(_command(case, tmp, name), cwd=tmp, env=_env(tmp, case.env), text=True,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    # interrupt each long run once its first checkpoint exists (the other cases drain meanwhile)
    signals = {"sigint": signal.SIGINT, "sigterm": signal.SIGTERM}
    pending = dict(signals)
    deadline = time.monotonic() + 400
    while pending and time.monotonic() < deadline:
        for name in list(pending):
            if (tmp / "runs" / name / "ckpt" / "grpo" / "latest").is_file() or procs[name].poll() is not None:
                if procs[name].poll() is None:
                    procs[name].send_signal(pending[name])
                del pending[name]
        time.sleep(0.2)
    results = {}
    for name, proc in procs.items():
        try:
            out, err = proc.communicate(timeout=max(10.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        results[name] = (cases.get(name), proc.returncode, out, err, time.perf_counter() - t0)
    # each interrupted run is continued with --resume, one step past its last checkpoint
    resumes = {}
    for name in INTERRUPTS:
        root = tmp / "runs" / name / "ckpt" / "grpo"
        step = json.loads((ckpt.resolve(root) / "state.json").read_text())["step"] if (root / "latest").is_file() else 0
        argv = _interrupt_run(tiny_ckpt, tmp, name)
        argv[argv.index("50")] = str(step + 1)
        resumes[name] = (step, subprocess.Popen(argv + ["--resume", str(root)], cwd=tmp, env=_env(tmp, {}), text=True,
                                                stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    for name, (step, proc) in resumes.items():
        out, err = proc.communicate(timeout=300)
        results[name + "_resume"] = (step, proc.returncode, out, err, time.perf_counter() - t0)
    results["_tmp"] = tmp
    return results


def _one_line(err: str, expect_traceback: bool = False) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    if expect_traceback:
        assert lines and lines[0].startswith("Traceback (most recent call last)"), err
        return lines[-1]
    assert "Traceback" not in err, err
    assert len(lines) == 1, f"expected exactly one stderr line, got {len(lines)}:\n{err}"
    return lines[0]


def _metrics(run_logs: Path) -> list[dict]:
    path = run_logs / "grpo" / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


@pytest.mark.slow
@pytest.mark.parametrize("name", SIMPLE)
def test_error_case(matrix, name):
    case, rc, out, err, _ = matrix[name]
    line = _one_line(err, case.traceback)
    assert re.search(case.pattern, line), f"{line!r} does not match {case.pattern!r}"
    assert re.match(r"(\S+: )?error: ", line), line
    assert rc == case.code, (rc, line)
    tmp = matrix["_tmp"]
    if name == "bad_empty":
        assert "has no tokenizer.json" not in line  # a missing checkpoint, not a missing tokenizer
    if name == "disk_full":
        root = tmp / "runs" / name / "ckpt" / "grpo"
        assert (root / "latest").read_text().strip() == "step_000001"
        assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000001"]  # no step_2, no temp dir
        info = ckpt.inspect(root)
        assert info.state["step"] == 1 and info.shapes
        assert load_file(str(info.path / "model.safetensors"))  # the previous checkpoint reads back whole
        assert [m["step"] for m in _metrics(tmp / "runs" / name / "logs")] == [1, 2]
    if name == "parity_broken":
        assert (tmp / "runs" / name / "logs" / "grpo" / "parity_failure_step000001.json").is_file()
        assert not (tmp / "runs" / name / "ckpt" / "grpo").exists()
    if name in ("loss_nan", "bug_has_traceback"):
        assert not (tmp / "runs" / name / "ckpt" / "grpo").exists()


@pytest.mark.slow
@pytest.mark.parametrize("name", INTERRUPTS)
def test_interrupt_flushes_logs_keeps_checkpoint_and_resumes(matrix, name):
    _, rc, out, err, _ = matrix[name]
    tmp = matrix["_tmp"]
    root = tmp / "runs" / name / "ckpt" / "grpo"
    if name == "sigint":  # stops at once
        line = _one_line(err)
        assert rc == 130, (rc, line)
        assert re.search(rf"^error: interrupted by SIGINT (during|after) step \d+.*; the logs are flushed; the last "
                         rf"checkpoint is .*step_\d+: continue with --resume {re.escape(str(root))}$", line), line
    else:  # SIGTERM, a scheduler's preemption: the next safe point, a checkpoint of the last completed step, exit 0
        assert rc == 0 and not err.strip(), (rc, err)
        said = re.search(rf"stopped by SIGTERM (after step (\d+)|during step (\d+) \(.*\)): the last completed step is "
                         rf"(\d+); continue with --resume {re.escape(str(root))}", out)
        assert said, out[-2000:]
        done = int(said[4])
        assert int(said[2] or int(said[3]) - 1) == done
        assert matrix[name + "_resume"][0] == done  # the checkpoint the resume found: the last completed step
    info = ckpt.inspect(root)  # the latest checkpoint is whole
    assert not [p for p in root.iterdir() if p.name.startswith(".")], list(root.iterdir())  # no temp leftovers
    steps = [m["step"] for m in _metrics(tmp / "runs" / name / "logs")]  # every line valid JSON
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= info.state["step"] >= 1
    step, rc2, out2, err2, _ = matrix[name + "_resume"]
    assert rc2 == 0 and not err2.strip(), err2
    assert f"resumed from {root / f'step_{step:06d}'} at step {step}" in out2
    assert [m["step"] for m in _metrics(tmp / "runs" / name / "logs")] == list(range(1, step + 2))
    assert ckpt.inspect(root).state["step"] == step + 1


# -- in-process: the same machinery for the remaining CLIs, and its invariants --------------------------


def test_weights_check_six_bad_directories(tiny_ckpt, tmp_path, capsys):
    import weights

    for name, d in bad_dirs(tiny_ckpt, tmp_path).items():
        assert weights.main(["--check", str(d)]) == weights.EXIT_CHECKPOINT == 1, name
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("weights.py: error: "), (name, lines)


def test_weights_exit_codes_agree_with_spirl_errors():
    import weights

    assert (weights.EXIT_USAGE, weights.EXIT_IO, weights.EXIT_BUG, weights.EXIT_SIGINT) == \
        (errors.EXIT_USAGE, errors.EXIT_IO, errors.EXIT_BUG, errors.EXIT_SIGINT)


def test_exit_codes_are_distinct():
    codes = [v for k, v in vars(errors).items() if k.startswith("EXIT_")]
    assert len(codes) == len(set(codes))


def _run_cli(main, argv) -> int:
    """errors.run_cli in-process; argparse's own exits (status 2) pass through run_cli as SystemExit."""
    try:
        return errors.run_cli(main, argv)
    except SystemExit as e:
        return e.code


@pytest.mark.parametrize("argv, env, code, pattern", [
    (["--model", "{tiny}", "--quick"], {}, 4, r"VLLM_BATCH_INVARIANT=1 is not set"),
    (["--quick"], {}, 2, r"the following arguments are required: --model"),
])
def test_parity_matrix_cli(argv, env, code, pattern, tiny_ckpt, capsys, monkeypatch):
    from compare.parity_matrix import main

    monkeypatch.delenv("VLLM_BATCH_INVARIANT", raising=False)
    rc = _run_cli(main, [a.format(tiny=tiny_ckpt) for a in argv])
    lines = capsys.readouterr().err.strip().splitlines()
    assert rc == code and len(lines) == 1 and re.search(pattern, lines[0]), (rc, lines)


def test_retokenization_and_warmstart_clis(tiny_ckpt, tmp_path, capsys):
    from compare.retokenization import main as retok_main
    from spirl.loops.warmstart import main as warmstart_main

    rollouts = tmp_path / "r.jsonl"
    rollouts.write_text("{}\n")
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("x")
    for main, argv, code, pattern in [
        (retok_main, ["--rollouts", str(tmp_path / "none.jsonl"), "--model", str(tiny_ckpt)], 2, r"no such file"),
        (retok_main, ["--rollouts", str(rollouts), "--model", str(tiny_ckpt)], 2, r"is not a rollout record"),
        (warmstart_main, ["--model", str(tmp_path / "empty"), "--out", str(tmp_path / "o")], 3,
         r"config\.json is missing"),
        (warmstart_main, ["--model", str(tiny_ckpt), "--out", str(tmp_path / "file" / "o")], 6,
         r"--out: cannot create"),
        (warmstart_main, ["--model", str(tiny_ckpt), "--out", str(tmp_path / "o"), "--device", "cuda:7"], 4,
         r"--device cuda:7"),
    ]:
        if torch.cuda.is_available() and "cuda:7" in argv and torch.cuda.device_count() > 7:
            continue
        rc = _run_cli(main, argv)
        lines = capsys.readouterr().err.strip().splitlines()
        assert rc == code and len(lines) == 1 and re.search(pattern, lines[0]), (argv, rc, lines)


def test_run_cli_maps_errors_and_prints_tracebacks_only_for_bugs(capsys, monkeypatch):
    import errno as errno_

    monkeypatch.delenv("SPIRL_DEBUG", raising=False)
    monkeypatch.setattr(errors, "_debug", None)

    def raising(e):
        def main(argv):
            raise e
        return main

    cases = [
        (errors.UserError("bad thing; do this", errors.EXIT_IO), 6, "error: bad thing; do this"),
        (OSError(errno_.ENOSPC, "No space left on device", "/x/y"), 6, "error: disk full writing /x/y"),
        (KeyboardInterrupt(), 130, "error: interrupted"),
        (ModuleNotFoundError("No module named 'vllm'", name="vllm"), 4, "error: vLLM is not installed"),
        (ModuleNotFoundError("No module named 'datasets'", name="datasets"), 4,
         "error: the Python package 'datasets' is not installed"),
    ]
    for e, code, start in cases:
        assert errors.run_cli(raising(e), []) == code
        err = capsys.readouterr().err
        assert err.startswith(start) and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert errors.run_cli(raising(ZeroDivisionError("x")), []) == errors.EXIT_BUG
    err = capsys.readouterr().err
    assert err.startswith("Traceback") and err.splitlines()[-1].startswith("error: internal error (a bug)")
    assert errors.run_cli(raising(errors.UserError("one line")), ["--debug"]) == errors.EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith("Traceback") and err.splitlines()[-1] == "error: one line"
