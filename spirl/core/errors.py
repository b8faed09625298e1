"""One error path for users: every expected failure ends as ONE line on stderr and a distinct exit status.

Every entry point (`simple_rl.py`, `compare/*.py`, `python -m spirl.loops.warmstart`) runs its `main`
through `run_cli`, which turns the project's expected errors into one line (what is wrong, what
to do) and the exit status below. Anything else is a bug: its traceback is printed, then one
line, and the status is 70. `--debug` (simple_rl.py: `--debug 1`) or `SPIRL_DEBUG=1` prints the
traceback of every error. `weights.py` sits below `spirl` in the import layering
(tests/test_layering.py), so it keeps its own copy of the codes it uses (2, 6, 70, 130), and
reports an unusable checkpoint with the status 1 it has always used.

Exit statuses:
    0    success
    1    compare tools only: the check ran and found differing logprobs (like diff: 0 same, 1 different)
    2    bad arguments or config: a flag's value, an unknown task, a prompt longer than max_model_len, a
         --dataset that cannot be read or has a bad row, a --reward function that cannot be loaded, raises or
         returns something other than one number (or None) per sample
    3    unusable model or checkpoint: config.json, safetensors, tokenizer, a failed download, --resume
    4    environment: no CUDA, vLLM missing or not the pinned version, VLLM_BATCH_INVARIANT unset,
         a missing Python package
    5    GPU memory: the memory plan refused the run, or CUDA ran out of memory
    6    I/O: an output directory that is not writable, a full disk, permission denied
    7    training stopped: engine and trainer logprobs differ (parity broken)
    8    training stopped: the loss became NaN/Inf
    9    training stopped: another rank of a torchrun job failed (the line names it and its cause)
    70   internal error (a bug): the traceback is printed
    130  interrupted by SIGINT (Ctrl-C); 143 by SIGTERM (128 + the signal number)
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
import tempfile
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Sequence

EXIT_OK = 0
EXIT_DIFFERENT = 1
EXIT_USAGE = 2
EXIT_MODEL = 3
EXIT_ENVIRONMENT = 4
EXIT_MEMORY = 5
EXIT_IO = 6
EXIT_PARITY = 7
EXIT_DIVERGED = 8
EXIT_PEER_FAILED = 9
EXIT_BUG = 70
EXIT_SIGINT = 130
EXIT_SIGTERM = 143

_PROJECT_PACKAGES = {"spirl", "torchtitan_compat", "weights", "weights_vllm_compat", "compare", "spirl_kernels",
                     "batch_invariant_backward", "simple_rl"}
_IO_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS}


class UserError(Exception):
    """An expected failure: `message` is one line saying what is wrong and what to do."""

    def __init__(self, message: str, exit_code: int = EXIT_USAGE):
        super().__init__(message)
        self.exit_code = exit_code


# -- debug switch --------------------------------------------------------------------------------

_debug: bool | None = None


def set_debug(on: bool) -> None:
    """Print tracebacks of every error (simple_rl.py `--debug 1`, the CLIs' `--debug`)."""
    global _debug
    _debug = bool(on)


def debug_enabled() -> bool:
    return bool(_debug) or os.environ.get("SPIRL_DEBUG", "").strip().lower() in ("1", "true", "yes", "on")


# -- classification ------------------------------------------------------------------------------

# (module, class, exit status, what to append when the message does not already say what to do).
# A class is only looked up if its module is already imported: an exception cannot be an instance
# of a class that was never loaded, and this keeps run_cli free of heavy imports.
_KNOWN: list[tuple[str, str, int, str]] = [
    ("spirl.core.config", "ConfigError", EXIT_USAGE, ""),
    ("spirl.tasks", "TaskError", EXIT_USAGE, ""),
    ("spirl.tasks.rewards", "RewardError", EXIT_USAGE, ""),
    ("spirl.tasks.dataset", "DatasetError", EXIT_USAGE, ""),
    ("spirl.loops.filters", "FilterError", EXIT_USAGE, ""),
    ("torchtitan_compat.config", "ConfigError", EXIT_MODEL, ""),
    ("torchtitan_compat.tokenizer", "TokenizerError", EXIT_MODEL, ""),
    ("weights", "WeightsError", EXIT_MODEL, ""),
    ("spirl.core.preflight", "ModelError", EXIT_MODEL, ""),
    ("spirl.core.checkpoint", "CheckpointError", EXIT_MODEL, ""),
    ("torchtitan_compat.peft_adapter", "AdapterError", EXIT_MODEL, ""),
    ("torchtitan_compat.lora", "LoRAError", EXIT_USAGE, ""),
    ("torchtitan_compat.ops", "BackendError", EXIT_ENVIRONMENT, ""),
    ("spirl.numerics.parity", "ParityError", EXIT_PARITY,
     "parity broken at {msg}; that step's update was not applied and the last checkpoint is kept: "
     "read the report, localize with ./run_comparison.sh --localize"),
    ("spirl.loops.update", "NonFiniteLossError", EXIT_DIVERGED,
     "training diverged: {msg}; lower --lr or set --max-grad-norm, then --resume from the last checkpoint"),
]


def one_line(text: object) -> str:
    """Whitespace (newlines included) collapsed: a message printed as exactly one line."""
    return " ".join(str(text).split())


def _first_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return lines[0] if lines else type(e).__name__


def classify(e: BaseException) -> tuple[int, str] | None:
    """(exit status, one-line message) of an expected failure; None for a bug."""
    if isinstance(e, UserError):
        return e.exit_code, one_line(e)
    for module, name, code, template in _KNOWN:
        cls = getattr(sys.modules.get(module), name, None)
        if isinstance(cls, type) and isinstance(e, cls):
            msg = one_line(e)
            return code, one_line(template.format(msg=msg)) if template else msg
    if isinstance(e, KeyboardInterrupt):
        signum = getattr(e, "signum", 2)
        return 128 + signum, "interrupted" if signum == 2 else f"interrupted by signal {signum}"
    torch = sys.modules.get("torch")
    oom = getattr(getattr(torch, "cuda", None), "OutOfMemoryError", None)
    if isinstance(oom, type) and isinstance(e, oom):
        return EXIT_MEMORY, ("CUDA out of memory (" + one_line(_first_line(e))[:160] + "); simple_rl.py: "
                             "lower --max-tokens-per-microbatch or --gpu-memory-utilization, set "
                             "--activation-checkpointing 1, --vllm-sleep 1 or --kl-coef 0; compare tools: lower "
                             "--gpu-memory-utilization")
    if isinstance(e, OSError) and e.errno in _IO_ERRNOS:
        where = f" {e.filename}" if e.filename else ""
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            return EXIT_IO, f"disk full writing{where} ({e.strerror}); free space or write elsewhere, then retry"
        return EXIT_IO, f"cannot write{where} ({e.strerror}); choose a directory you can write to"
    if isinstance(e, ModuleNotFoundError) and e.name:
        top = e.name.split(".")[0]
        if top == "vllm":
            return EXIT_ENVIRONMENT, ("vLLM is not installed (no module named 'vllm'): on a CUDA machine "
                                      f"pip install vllm=={pinned_vllm_version()}; on the CPU use --engine native")
        if top not in _PROJECT_PACKAGES:
            return EXIT_ENVIRONMENT, (f"the Python package {top!r} is not installed: pip install -e . "
                                      "(see README.md) or pip install it")
    return None


def report(e: BaseException, prog: str | None = None, file=None) -> int:
    """Write the one line (and a traceback for a bug or when debugging) to stderr; the exit status."""
    file = file if file is not None else sys.stderr
    prefix = f"{prog}: error: " if prog else "error: "
    known = classify(e)
    if known is None or debug_enabled():
        traceback.print_exception(type(e), e, e.__traceback__, file=file)
    if known is None:
        file.write(f"{prefix}internal error (a bug): {type(e).__name__}: {one_line(_first_line(e))}; "
                   "please report it with the traceback above\n")
        file.flush()
        return EXIT_BUG
    code, message = known
    file.write(f"{prefix}{message}\n")
    file.flush()
    return code


@contextmanager
def one_line_argparse_errors():
    """Within the block, argparse usage errors are one line on stderr (no usage dump), status 2.
    Parsers that define their own `error` (spirl.core.config.OneLineParser, ...) are unaffected."""
    original = argparse.ArgumentParser.error

    def error(self, message):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {one_line(message)} (see {self.prog} --help)\n")

    argparse.ArgumentParser.error = error
    try:
        yield
    finally:
        argparse.ArgumentParser.error = original


def run_cli(main: Callable[[list[str]], int | None], argv: Sequence[str] | None = None, *,
            prog: str | None = None, debug_flag: bool = True) -> int:
    """Run `main(argv)` and return its exit status; every expected failure becomes one stderr line.

    `debug_flag`: a bare `--debug` in argv turns tracebacks on and is removed before `main` sees
    it (simple_rl.py passes False: its `--debug 1` is a TrainConfig field). `SystemExit` with a
    number passes through (argparse, --help); one with a message (`raise SystemExit("error: ...")`)
    is printed as one line with status 2. Use as `sys.exit(run_cli(main))`."""
    args = list(sys.argv[1:] if argv is None else argv)
    if debug_flag and "--debug" in args:
        args = [a for a in args if a != "--debug"]
        set_debug(True)
    try:
        with one_line_argparse_errors():
            rc = main(args)
        return EXIT_OK if rc is None else int(rc)
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            raise
        msg = one_line(e.code)
        msg = msg.removeprefix("error:").strip()
        sys.stderr.write(f"{prog}: error: {msg}\n" if prog else f"error: {msg}\n")
        return EXIT_USAGE
    except BaseException as e:  # noqa: BLE001 - the one place every failure is turned into a status
        return report(e, prog)


def log_to_stdout(fmt: str = "%(asctime)s %(name)s: %(message)s") -> None:
    """Every log record and warning to stdout, so stderr holds only the one error line: Python's
    logging, `warnings` (captured), and transformers' own logger (which writes to stderr by itself:
    e.g. a tokenizer-regex notice some transformers versions print for any local tokenizer)."""
    import logging

    logging.basicConfig(level=logging.INFO, format=fmt, stream=sys.stdout)
    logging.captureWarnings(True)
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return
    hf_logging.disable_default_handler()
    hf_logging.enable_propagation()


# -- the environment checks a user hits first -------------------------------------------------------


def pinned_vllm_version() -> str:
    try:
        from torchtitan_compat.vllm_ops import PINNED_VLLM_VERSION
    except Exception:  # noqa: BLE001 - only used to word a message
        return "0.26.0"
    return PINNED_VLLM_VERSION


def require_batch_invariant(alternative: str = "") -> None:
    """VLLM_BATCH_INVARIANT=1 must be in the environment before vllm is imported."""
    if os.environ.get("VLLM_BATCH_INVARIANT") != "1":
        raise UserError("VLLM_BATCH_INVARIANT=1 is not set (vLLM reads it when it is imported, so it cannot be "
                        f"set later): start with `VLLM_BATCH_INVARIANT=1 python ...`{alternative}", EXIT_ENVIRONMENT)


def require_vllm(alternative: str = "") -> str:
    """vLLM importable, at the pinned version; returns the version."""
    pinned = pinned_vllm_version()
    try:
        import vllm
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] != "vllm":
            raise UserError(f"vLLM is installed but cannot be imported (it needs the missing module {e.name!r}): "
                            f"reinstall with pip install vllm=={pinned}", EXIT_ENVIRONMENT) from e
        raise UserError(f"vLLM is not installed: pip install vllm=={pinned} on a CUDA machine{alternative}",
                        EXIT_ENVIRONMENT) from None
    except Exception as e:  # noqa: BLE001 - a broken install fails in many ways (CUDA libraries, ABI, ...)
        raise UserError(f"vLLM is installed but cannot be imported ({type(e).__name__}: {one_line(_first_line(e))}); "
                        f"reinstall with pip install vllm=={pinned}", EXIT_ENVIRONMENT) from e
    version = getattr(vllm, "__version__", None)
    if version != pinned:
        raise UserError(f"vLLM {version} is installed, but bitwise parity is only proven for vLLM {pinned}: "
                        f"pip install vllm=={pinned}", EXIT_ENVIRONMENT)
    return version


def require_cuda(what: str, alternative: str = "") -> None:
    import torch

    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise UserError(f"{what} needs a CUDA GPU, but torch sees none (torch {torch.__version__}, {build}; "
                        f"check nvidia-smi and CUDA_VISIBLE_DEVICES){alternative}", EXIT_ENVIRONMENT)


def require_writable_dir(path: str | Path, flag: str) -> None:
    """`path` (created later if missing) can be written: its nearest existing ancestor is a
    directory in which a file can be created. Creates nothing that stays."""
    path = Path(path)
    p = path
    while not p.exists() and p != p.parent:
        p = p.parent
    if not p.is_dir():
        raise UserError(f"{flag}: cannot create {path}: {p} exists and is not a directory; "
                        f"pass another {flag}", EXIT_IO)
    try:
        fd, name = tempfile.mkstemp(prefix=".spirl-write-test-", dir=p)
        os.close(fd)
        os.unlink(name)
    except OSError as e:
        raise UserError(f"{flag}: cannot write {path} ({p}: {e.strerror}); pass a directory you can write "
                        f"to with {flag}", EXIT_IO) from e
