"""One chat reply's text -> the message fields: reasoning_content, content and tool_calls.

The reasoning parser (serve/reasoning.py) runs first, in thinking mode; the answer after it goes
through the tool-call scanner (serve/tool_calls.py) when the request parses calls. A streamed
reply feeds its deltas; a full one feeds its whole text once, so both give the same fields.
"""

from __future__ import annotations

from deepinfer.serve.reasoning import ReasoningSplitter
from deepinfer.serve.tool_calls import ToolCallScanner, openai_tool_calls


class ReplyParser:
    def __init__(self, reasoning: bool, tool_calls: bool):
        self._splitter = ReasoningSplitter() if reasoning else None
        self._scanner = ToolCallScanner() if tool_calls else None
        self.num_calls = 0

    @property
    def has_reasoning(self) -> bool:
        return self._splitter is not None

    def feed(self, text: str) -> dict:
        """The delta's fields (only those with something new)."""
        reasoning, content = self._splitter.feed(text) if self._splitter else ("", text)
        return self._fields(reasoning, content, final=False)

    def finish(self) -> dict:
        """What was held back, once the reply ended."""
        reasoning, content = self._splitter.finish() if self._splitter else ("", "")
        return self._fields(reasoning, content, final=True)

    def _fields(self, reasoning: str, content: str, final: bool) -> dict:
        calls = []
        if self._scanner is not None:
            content, calls = self._scanner.feed(content)
            if final:
                content += self._scanner.finish()
        fields = {}
        if reasoning:
            fields["reasoning_content"] = reasoning
        if content:
            fields["content"] = content
        if calls:
            fields["tool_calls"] = openai_tool_calls(calls, first_index=self.num_calls)
            self.num_calls += len(calls)
        return fields

    def finish_reason(self, engine_reason: str | None) -> str | None:
        # A reply that ended by itself (EOS, or the call grammar complete) after calling tools.
        return "tool_calls" if self.num_calls and engine_reason == "stop" else engine_reason


def merge_fields(fields: dict, more: dict) -> dict:
    """`fields` followed by `more` (texts and call lists concatenated)."""
    for key, value in more.items():
        fields[key] = fields[key] + value if key in fields else value
    return fields


def full_message(parser: ReplyParser, text: str) -> dict:
    """The non-streamed `message` of a reply whose whole text is `text`."""
    fields = merge_fields(parser.feed(text), parser.finish())
    message = {"role": "assistant", "content": fields.get("content", "")}
    if parser.has_reasoning:
        message["reasoning_content"] = fields.get("reasoning_content", "")
    if "tool_calls" in fields:
        message["tool_calls"] = [{k: v for k, v in c.items() if k != "index"}
                                 for c in fields["tool_calls"]]
    if not message["content"] and (parser.has_reasoning or "tool_calls" in message):
        message["content"] = None
    return message
