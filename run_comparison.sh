#!/usr/bin/env bash
# Bitwise parity check between vLLM's sampled-token logprobs and the trainer's forward.
#   ./run_comparison.sh "The capital of France is"
#   ./run_comparison.sh --model Qwen/Qwen3-0.6B --max-tokens 64 --samples 4 --batch 8 "Once upon a time"
# Every option but the prompt is passed to compare/direct_forward.py (see --help there too).
# Exit status 0 only on an exact bitwise match, 1 when logprobs differ; any other failure is one
# line on stderr with the status of spirl/core/errors.py (2 arguments, 3 model, 4 environment, ...).
# --debug (or SPIRL_DEBUG=1) adds the traceback.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"

usage() {
  cat <<USAGE
usage: $0 [options] "<prompt>"

Generates with vLLM (batch-invariant mode), recomputes with Qwen3VLLMCompatModel, prints a
per-token table and "EXACT BITWISE MATCH" or the first mismatch.

options (passed through to compare/direct_forward.py):
  --model DIR|REPO       checkpoint directory or Hugging Face repo id (default: \$SPIRL_MODEL or Qwen/Qwen3-1.7B)
  --max-tokens N         tokens to generate per sample (default 32)
  --samples N            samples per prompt (default 1)
  --batch N              prompts in the generate call: yours + N-1 random ones (default 1)
  --temperature T        sampling temperature (default 1.0)
  --seed S               sampling seed (default 0)
  --localize             on a mismatch, report the first layer/op that differs
  --backend reference    trainer in plain PyTorch (expected to FAIL: shows the check has teeth)
  --swap-op OP           one op in plain PyTorch (expected to FAIL)
  --debug                print the traceback of an error (same as SPIRL_DEBUG=1)
  -h, --help             this help
USAGE
}

args=() prompt="" model="${SPIRL_MODEL:-Qwen/Qwen3-1.7B}"
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0;;
    --model) [ $# -ge 2 ] || { echo "error: --model needs a value (a checkpoint directory or a Hugging Face repo id)" >&2; exit 2; }
             model="$2"; shift 2;;
    --localize) args+=("$1"); shift;;
    --debug) export SPIRL_DEBUG=1; shift;;
    --*) [ $# -ge 2 ] || { echo "error: $1 needs a value" >&2; exit 2; }; args+=("$1" "$2"); shift 2;;
    *) [ -z "$prompt" ] || { echo "error: more than one prompt given; quote the prompt" >&2; exit 2; }
       prompt="$1"; shift;;
  esac
done
[ -n "$prompt" ] || { echo "error: no prompt given: $0 [options] \"<prompt>\" (see --help)" >&2; exit 2; }

export VLLM_BATCH_INVARIANT=1 VLLM_ENABLE_V1_MULTIPROCESSING=0
export VLLM_USE_FLASHINFER_SAMPLER="${VLLM_USE_FLASHINFER_SAMPLER:-0}" PYTHONUNBUFFERED=1
# -m with the repo root on PYTHONPATH: runs from a checkout, installed or not
PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}" exec "${PYTHON:-python}" -m compare.direct_forward --model "$model" --prompt "$prompt" "${args[@]}"
