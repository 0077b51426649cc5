"""The model's DSML call blocks found in its reply text, as OpenAI `tool_calls`.

`ToolCallScanner` takes the answer text (after any reasoning) in deltas and releases the text
that is content; a complete, well-formed block becomes calls, and a block that does not parse
(serve/dsml.py::parse_calls) is released as the text it was. The result does not depend on how
the text was cut: text that may start a block (whitespace, then part of `<｜DSML｜tool_calls>`) is
held until the next delta decides it, and an open block is held until it closes or the reply
ends (then it is text). Whitespace between the text and a block, and after the last block, is
the markup's, not content.
"""

from __future__ import annotations

import uuid

from deepinfer.serve.dsml import CALLS_BEGIN, CALLS_END, parse_calls, to_json
from deepinfer.serve.reasoning import held_prefix_len


class ToolCallScanner:
    def __init__(self):
        self._buf = ""
        self._in_block = False
        self.calls: list[tuple[str, dict]] = []

    def feed(self, text: str) -> tuple[str, list[tuple[str, dict]]]:
        """(content released now, calls completed now)."""
        self._buf += text
        content, new = [], []
        while True:
            if self._in_block:
                end = self._buf.find(CALLS_END, self._buf.find(CALLS_BEGIN) + len(CALLS_BEGIN))
                if end < 0:
                    break
                end += len(CALLS_END)
                raw, self._buf, self._in_block = self._buf[:end], self._buf[end:], False
                body = raw[raw.find(CALLS_BEGIN) + len(CALLS_BEGIN):-len(CALLS_END)]
                calls = parse_calls(body)
                if calls is None:
                    content.append(raw)
                else:
                    new.extend(calls)
                continue
            start = self._buf.find(CALLS_BEGIN)
            cut = start if start >= 0 else len(self._buf) - held_prefix_len(self._buf, CALLS_BEGIN)
            while cut > 0 and self._buf[cut - 1].isspace():
                cut -= 1
            content.append(self._buf[:cut])
            self._buf = self._buf[cut:]
            if start < 0:
                break
            self._in_block = True
        self.calls.extend(new)
        return "".join(content), new

    def finish(self) -> str:
        """The content still held back when the reply ends (an unclosed block is text)."""
        rest, self._buf = self._buf, ""
        if self.calls and not self._in_block and not rest.strip():
            return ""
        return rest


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def openai_tool_calls(calls: list[tuple[str, dict]], first_index: int | None = None) -> list[dict]:
    """OpenAI `tool_calls` entries; with first_index (a stream's delta) each carries its index
    in the reply's list, and the whole call comes in this one delta."""
    out = []
    for k, (name, arguments) in enumerate(calls):
        entry = {"id": new_call_id(), "type": "function",
                 "function": {"name": name, "arguments": to_json(arguments)}}
        if first_index is not None:
            entry = {"index": first_index + k, **entry}
        out.append(entry)
    return out
