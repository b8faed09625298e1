"""python -m spirl.tinker SCRIPT.py [ARGS...]   (or: python -m spirl.tinker -m MODULE [ARGS...])
   python -m spirl.tinker --surface               (the SDK's public methods: implemented / refused, and why)

Runs an unmodified Tinker script against SPIRL on this machine: the SDK's client classes are
replaced by SPIRL's (spirl/tinker/clients.py) before the script is imported, so `tinker.ServiceClient()`
and `from tinker import ServiceClient` both get the local backend. Environment: SPIRL_ENGINE
(vllm|native; default vllm with a GPU, native on the CPU), SPIRL_TINKER_DIR (checkpoints, default
./tinker_runs), SPIRL_GPU_MEMORY_UTILIZATION, SPIRL_MAX_MODEL_LEN. A base model is a local Qwen3
checkpoint directory, a Hub id (downloaded by huggingface_hub), or random:<shape>. With
tinker-cookbook installed its model-pricing download is skipped (it would wait 5 s offline).

Why patch: the SDK has no pluggable backend short of re-implementing its wire protocol; the one
place this patch lives is `install()`, and it changes nothing else of the SDK.
"""

from __future__ import annotations

import os
import runpy
import sys


def install() -> None:
    """Make the tinker SDK's client classes SPIRL's (module attributes the scripts look up)."""
    import tinker
    import tinker.lib.public_interfaces as public

    from . import clients

    for module in (tinker, public):
        module.ServiceClient = clients.ServiceClient
        module.TrainingClient = clients.TrainingClient
        module.SamplingClient = clients.SamplingClient
        module.RestClient = clients.RestClient
    try:  # tinker-cookbook: no 5 s pricing download on every run (it is offline-safe but slow)
        import tinker_cookbook.utils.cost_estimation as cost

        cost._pricing_fetched = True
    except ImportError:
        pass


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    if argv[0] == "--surface":  # the SDK's surface: implemented / refused, as README's table
        from . import clients, rest
        from .surface import surface_table

        print(surface_table([clients.ServiceClient, clients.TrainingClient, clients.SamplingClient, rest.RestClient]))
        return 0
    from ..core.errors import log_to_stdout

    if argv[0] == "-m" and len(argv) < 2:
        print("spirl.tinker: error: -m needs a module name", file=sys.stderr)
        return 2
    if argv[0] != "-m" and not os.path.isfile(argv[0]):
        print(f"spirl.tinker: error: no script {argv[0]}; usage: python -m spirl.tinker SCRIPT.py [ARGS...]",
              file=sys.stderr)
        return 2
    log_to_stdout("%(asctime)s %(name)s %(levelname)s %(message)s")
    install()
    from .process import close as close_session

    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            script = os.path.abspath(argv[0])
            sys.argv = [script, *argv[1:]]
            sys.path.insert(0, os.path.dirname(script))  # as `python SCRIPT.py` does
            runpy.run_path(script, run_name="__main__")
    finally:  # the engine is closed on every way out, errors and Ctrl-C included (vLLM's process group with it)
        close_session()
    return 0


if __name__ == "__main__":
    from ..core.errors import run_cli

    sys.exit(run_cli(main, sys.argv[1:], prog="spirl.tinker", debug_flag=False))
