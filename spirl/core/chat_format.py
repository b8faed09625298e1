"""Token ids of a tool-using chat, produced from the model's own chat template.

The prompt is rendered once (system + tools + user + generation prompt). After that, the policy's
turns are appended as sampled ids and each environment reply is tokenized *on its own*:

    <|im_end|>   <- last token of the sampled turn (the policy's own stop token)
    \\n<|im_start|>user\\n<tool_response>\\n{content}\\n</tool_response><|im_end|>\\n
    <|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n   <- generation prompt of the next turn

The text around `{content}` is not written here: it is cut out of the template's own rendering
of a conversation with placeholder strings, so a different template gives different (correct)
boundaries. The reply is encoded as the template's text is, in one piece, with one exception: the
plain text between the last added token before the content and the first one after it
("\n{content}\n") is encoded with `split_special_tokens=True`, so a tool result that contains the
text "<|im_end|>" cannot end a turn. Added tokens are cut out before BPE runs, so this gives the
same ids as encoding the whole reply at once whenever the content holds no special-token text.
(Encoding the content alone would not: '}' + '\n' is one token, '}\n', in one piece.)
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_ASSISTANT = "\u0000ASSISTANT\u0000"
_CONTENT = "\u0000CONTENT\u0000"


class ChatFormatError(ValueError):
    """The chat template does not render tool replies the way this module expects."""


@dataclass
class ToolChatFormat:
    tokenizer: object
    tools: list[dict] = field(default_factory=list)
    """OpenAI-style function specs, rendered into the system prompt by the template."""
    enable_thinking: bool = False
    """Qwen3's switch: False pre-fills an empty think block in every generation prompt."""

    def __post_init__(self):
        self.turn_end_id = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        before, after = self._reply_boundaries()
        added = re.compile("|".join(re.escape(t) for t in sorted(self.tokenizer.get_added_vocab(), key=len,
                                                                  reverse=True)))
        cut_b = max((m.end() for m in added.finditer(before)), default=0)
        cut_a = min((m.start() for m in added.finditer(after)), default=len(after))
        self._before_ids = self._encode(before[:cut_b], split_special=False)
        self._text_before, self._text_after = before[cut_b:], after[:cut_a]
        self._after_ids = self._encode(after[cut_a:], split_special=False)

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=self.tools or None, tokenize=False,
                                                  add_generation_prompt=generation_prompt,
                                                  enable_thinking=self.enable_thinking)

    def _encode(self, text: str, split_special: bool) -> list[int]:
        enc = self.tokenizer(text, add_special_tokens=False, split_special_tokens=split_special)
        return [int(i) for i in enc["input_ids"]]

    def _reply_boundaries(self) -> tuple[str, str]:
        """(text between the sampled <|im_end|> and the content, text after the content up to and
        including the next generation prompt), cut from the template's own rendering."""
        msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": _ASSISTANT},
                {"role": "tool", "content": _CONTENT}]
        text = self._render(msgs, generation_prompt=True)
        end = "<|im_end|>"
        head = _ASSISTANT + end
        if text.count(head) != 1 or text.count(_CONTENT) != 1:
            raise ChatFormatError("the chat template does not close an assistant turn with <|im_end|> "
                                  "followed by the tool reply; this format supports Qwen3-style templates only")
        tail = text.split(head, 1)[1]
        before, after = tail.split(_CONTENT, 1)
        return before, after

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """The first prompt (system/tools, user, generation prompt), rendered once."""
        return self._encode(self._render(messages, generation_prompt=True), split_special=False)

    def reply_ids(self, content: str) -> list[int]:
        """An environment reply, tokenized alone, from just after the policy's <|im_end|> to the
        start of the policy's next turn (its generation prompt included)."""
        text = self._text_before + content + self._text_after
        return self._before_ids + self._encode(text, split_special=True) + self._after_ids

    def render_text(self, messages: list[dict], generation_prompt: bool = False) -> str:
        """The template's text for a whole conversation (for the naive-retokenization detector)."""
        return self._render(messages, generation_prompt)
