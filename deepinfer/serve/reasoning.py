"""The `deepseek_v4` reasoning parser: a thinking-mode reply's text before `</think>` is its
reasoning, the rest its answer.

The thinking-mode prompt already ends in `<think>` (serve/chat_template.py), so the reply starts
inside the reasoning; a `<think>` the model writes first anyway is dropped. Text is split the
same way however it is cut into deltas: a possible start of `</think>` is held back until the
next delta decides it. A reply that never writes `</think>` is reasoning only.
"""

from __future__ import annotations

from deepinfer.serve.chat_template import THINK_END, THINK_START

REASONING_PARSERS = ("deepseek_v4", "none")
DEFAULT_REASONING_PARSER = "deepseek_v4"


def held_prefix_len(text: str, tag: str) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of `tag` (the part of a
    tag that may be completed by the next delta)."""
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


class ReasoningSplitter:
    """Splits one reply's text deltas into (reasoning, content) deltas."""

    def __init__(self):
        self._buf = ""
        self._at_start = True  # nothing released yet: a leading <think> may still be dropped
        self.closed = False  # </think> seen: everything from here on is content

    def feed(self, text: str) -> tuple[str, str]:
        if self.closed:
            return "", text
        self._buf += text
        if self._at_start:
            if THINK_START.startswith(self._buf):
                return "", ""  # could still become the leading <think>
            if self._buf.startswith(THINK_START):
                self._buf = self._buf[len(THINK_START):]
            self._at_start = False
        end = self._buf.find(THINK_END)
        if end >= 0:
            reasoning, content = self._buf[:end], self._buf[end + len(THINK_END):]
            self._buf, self.closed = "", True
            return reasoning, content
        keep = held_prefix_len(self._buf, THINK_END)
        reasoning, self._buf = self._buf[:len(self._buf) - keep], self._buf[len(self._buf) - keep:]
        return reasoning, ""

    def finish(self) -> tuple[str, str]:
        """What is still held back: reasoning, as the reply ended without closing it."""
        rest, self._buf = self._buf, ""
        return rest, ""
