"""A chat request's `tools` and `tool_choice`: validated, and for `required` / a named function the
xgrammar structural tag that makes the reply a well-formed DSML call block.

none: the tools are left out of the prompt and the reply is plain text. auto: the model sees the
tools and whatever call block it writes is parsed (serve/tool_calls.py). required / a named
function: generation is constrained to one block of one or more calls (exactly one call of the
named function, or one when parallel_tool_calls is false) whose parameters follow each function's
JSON schema (xgrammar's deepseek_xml style: string-typed values raw, the others JSON), then EOS.
In thinking mode the reasoning comes first, unconstrained, up to `</think>`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from deepinfer.serve.chat_template import THINK_END
from deepinfer.serve.dsml import CALLS_BEGIN, CALLS_END, CALLS_PREFIX, INVOKE_BEGIN, INVOKE_END
from deepinfer.serve.errors import bad_request

# OpenAI's rule for function names; it also keeps a name from breaking out of the markup.
_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
# One whitespace character between the tags at most: a free model cannot stall there.
_MAX_WHITESPACE = 1
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolSpec:
    functions: list[dict]  # the OpenAI `function` objects, as sent (rendered into the prompt)
    choice: str  # "none", "auto", "required" or "function"
    name: str | None = None  # the function tool_choice names
    parallel: bool = True

    @property
    def prompt_tools(self) -> list[dict] | None:
        return self.functions if self.choice != "none" and self.functions else None

    @property
    def parses_calls(self) -> bool:
        return self.prompt_tools is not None

    @property
    def forced(self) -> bool:
        return self.choice in ("required", "function")

    def structural_tag(self, thinking: bool) -> str:
        """The constraint of a forced call (JSON text of an xgrammar structural tag)."""
        functions = [f for f in self.functions if self.choice != "function" or f["name"] == self.name]
        invokes = [{"type": "tag", "begin": INVOKE_BEGIN.format(name=f["name"]),
                    "content": {"type": "json_schema", "style": "deepseek_xml",
                                "json_schema": f.get("parameters") or EMPTY_PARAMETERS,
                                "max_whitespace_cnt": _MAX_WHITESPACE},
                    "end": INVOKE_END + "\n"} for f in functions]
        block = {"type": "tag", "begin": CALLS_PREFIX + CALLS_BEGIN + "\n",
                 "content": {"type": "tags_with_separator", "tags": invokes, "separator": "",
                             "at_least_one": True,
                             "stop_after_first": self.choice == "function" or not self.parallel},
                 "end": CALLS_END}
        if thinking:
            reasoning = {"type": "tag", "begin": "", "content": {"type": "any_text"}, "end": THINK_END}
            block = {"type": "sequence", "elements": [reasoning, block]}
        return json.dumps({"type": "structural_tag", "format": block}, ensure_ascii=False)


def tool_spec(tools, tool_choice, parallel_tool_calls) -> ToolSpec | None:
    """The request's tools, or None when it has none and chooses none; a 400 naming the field
    for anything malformed."""
    functions = [_function(i, t) for i, t in enumerate(tools or [])]
    names = [f["name"] for f in functions]
    for name in names:
        if names.count(name) > 1:
            raise bad_request(f"tools: function {name!r} is defined more than once", "tools")
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise bad_request("parallel_tool_calls must be a bool", "parallel_tool_calls")
    parallel = parallel_tool_calls is not False
    if tool_choice is None:
        return ToolSpec(functions, "auto", parallel=parallel) if functions else None
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise bad_request(f"tool_choice must be none, auto, required or a function, got "
                              f"{tool_choice!r}", "tool_choice")
        if tool_choice == "required" and not functions:
            raise bad_request("tool_choice required needs tools", "tool_choice")
        return ToolSpec(functions, tool_choice, parallel=parallel)
    function = tool_choice.get("function") if tool_choice.get("type") == "function" else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise bad_request('tool_choice must be none, auto, required or {"type": "function", '
                          '"function": {"name": ...}}', "tool_choice")
    if name not in names:
        raise bad_request(f"tool_choice names function {name!r}, which is not in tools", "tool_choice")
    return ToolSpec(functions, "function", name=name, parallel=parallel)


def _function(i: int, tool) -> dict:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise bad_request(f'{where} must be an object with "type": "function"', "tools")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise bad_request(f"{where}.function must be an object", "tools")
    name = function.get("name")
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise bad_request(f"{where}.function.name must be 1-64 letters, digits, _ or -, got {name!r}",
                          "tools")
    if function.get("description") is not None and not isinstance(function["description"], str):
        raise bad_request(f"{where}.function.description must be a string", "tools")
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise bad_request(f"{where}.function.parameters must be a JSON schema object", "tools")
    return function
