"""DeepSeek V4's DSML markup: tool schemas in the prompt, tool calls, tool results.

The format is DeepSeek's published V4 encoding (docs/chat_template.md states the rules). "｜DSML｜"
(fullwidth bars) is one token of the V4 vocabulary; the tags around it are ordinary text. A tool
call block, as the model writes it after its answer text:

    \\n\\n<｜DSML｜tool_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

string="true" values are raw text; string="false" values are JSON.
"""

from __future__ import annotations

import json
import re

DSML = "｜DSML｜"
CALLS_BEGIN = f"<{DSML}tool_calls>"
CALLS_END = f"</{DSML}tool_calls>"
INVOKE_BEGIN = f'<{DSML}invoke name="{{name}}">\n'
INVOKE_END = f"</{DSML}invoke>"
PARAM_END = f"</{DSML}parameter>"
# What separates the answer text from the block in the history (and what the model writes).
CALLS_PREFIX = "\n\n"

# The model reads this section verbatim (it is the text it was trained on), so only the two
# placeholders vary: {dsml} and {schemas}, one JSON object per function, one per line.
_TOOLS_SECTION = """## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by \
writing a "<{dsml}tool_calls>" block like the following:

<{dsml}tool_calls>
<{dsml}invoke name="$TOOL_NAME">
<{dsml}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{dsml}parameter>
...
</{dsml}invoke>
<{dsml}invoke name="$TOOL_NAME2">
...
</{dsml}invoke>
</{dsml}tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types \
(numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning \
inside <think>...</think> BEFORE any tool calls or final response.

Otherwise, output directly after </think> with tool calls or final response.

### Available Tool Schemas

{schemas}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""


def to_json(value) -> str:
    # The encoding writes JSON with json.dumps' default separators and non-ASCII kept.
    return json.dumps(value, ensure_ascii=False)


def render_tools(functions: list[dict]) -> str:
    """The tools section of the system prompt for OpenAI `function` objects."""
    return _TOOLS_SECTION.format(dsml=DSML, schemas="\n".join(to_json(f) for f in functions))


def render_calls(calls: list[tuple[str, dict]]) -> str:
    """An assistant turn's tool calls, (name, arguments object) each, as the block that follows
    its text."""
    invokes = []
    for name, arguments in calls:
        params = "\n".join(_render_param(key, value) for key, value in arguments.items())
        invokes.append(INVOKE_BEGIN.format(name=name) + params + "\n" + INVOKE_END)
    return CALLS_PREFIX + CALLS_BEGIN + "\n" + "\n".join(invokes) + "\n" + CALLS_END


def _render_param(key: str, value) -> str:
    is_str = isinstance(value, str)
    text = value if is_str else to_json(value)
    return (f'<{DSML}parameter name="{key}" string="{"true" if is_str else "false"}">{text}'
            f"{PARAM_END}")


def render_tool_result(content: str) -> str:
    return f"<tool_result>{content}</tool_result>"


_INVOKE_RE = re.compile(rf'\s*<{DSML}invoke name="([^"<>\n]+)">(.*?){INVOKE_END}', re.S)
_PARAM_RE = re.compile(rf'\s*<{DSML}parameter name="([^"<>\n]+)" string="(true|false)">(.*?){PARAM_END}',
                       re.S)


def parse_calls(body: str) -> list[tuple[str, dict]] | None:
    """The calls of a block's body (the text between CALLS_BEGIN and CALLS_END), or None when it
    is not well formed: anything but whitespace between the tags, a string="false" value that is
    not JSON, a parameter named twice, or no call at all."""
    calls, pos = [], 0
    while True:
        m = _INVOKE_RE.match(body, pos)
        if m is None:
            break
        arguments = _parse_params(m.group(2))
        if arguments is None:
            return None
        calls.append((m.group(1), arguments))
        pos = m.end()
    if not calls or body[pos:].strip():
        return None
    return calls


def _parse_params(body: str) -> dict | None:
    arguments, pos = {}, 0
    while True:
        m = _PARAM_RE.match(body, pos)
        if m is None:
            break
        name, is_str, raw = m.groups()
        if name in arguments:
            return None
        if is_str == "true":
            arguments[name] = raw
        else:
            try:
                arguments[name] = json.loads(raw)
            except ValueError:
                return None
        pos = m.end()
    if body[pos:].strip():
        return None
    return arguments
