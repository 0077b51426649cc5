"""Reasoning and tool-call parsing of chat replies (serve/reply_parser.py): the fields a reply's
text gives, full and streamed, with the text cut at every character."""

from __future__ import annotations

import json

import pytest

from deepinfer.serve.reply_parser import ReplyParser, full_message

D = "｜DSML｜"
BLOCK = (f"\n\n<{D}tool_calls>\n<{D}invoke name=\"get_weather\">\n"
         f'<{D}parameter name="city" string="true">Paris</{D}parameter>\n'
         f'<{D}parameter name="days" string="false">3</{D}parameter>\n'
         f"</{D}invoke>\n<{D}invoke name=\"now\">\n\n</{D}invoke>\n</{D}tool_calls>")
CALLS = [("get_weather", {"city": "Paris", "days": 3}), ("now", {})]
BROKEN = f"\n\n<{D}tool_calls>\n<{D}invoke name=\"f\">\nnot a parameter\n</{D}invoke>\n</{D}tool_calls>"

# (reply text, thinking, tools) -> (reasoning_content, content, calls)
CASES = [
    ("Let me think.</think>It is 4.", True, False, ("Let me think.", "It is 4.", [])),
    ("<think>lead</think>x", True, False, ("lead", "x", [])),  # a repeated <think> is dropped
    ("never closes </thi", True, False, ("never closes </thi", None, [])),
    ("a < b </think", True, False, ("a < b </think", None, [])),
    ("</think>", True, False, ("", None, [])),
    ("plain </think> text", False, False, (None, "plain </think> text", [])),
    ("Checking." + BLOCK, False, True, (None, "Checking.", CALLS)),
    (BLOCK + "\n", False, True, (None, None, CALLS)),
    ("why</think>" + BLOCK, True, True, ("why", None, CALLS)),
    ("Oops" + BROKEN, False, True, (None, "Oops" + BROKEN, [])),  # malformed: stays text
    ("cut off" + BLOCK[:40], False, True, (None, "cut off" + BLOCK[:40], [])),  # never closed
    ("a <｜DSML｜tool_c and more  ", False, True, (None, "a <｜DSML｜tool_c and more  ", [])),
    ("no tools" + BLOCK, False, False, (None, "no tools" + BLOCK, [])),  # tool_choice none
    (BROKEN + " then" + BLOCK, False, True, (None, BROKEN + " then", CALLS)),
]


def _calls(tool_calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in tool_calls or []]


def _streamed(text: str, cuts: list[int], thinking: bool, tools: bool):
    parser = ReplyParser(thinking, tools)
    deltas, bounds = [], [0, *cuts, len(text)]
    for a, b in zip(bounds, bounds[1:]):
        deltas.append(parser.feed(text[a:b]))
    deltas.append(parser.finish())
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    content = "".join(d.get("content", "") for d in deltas)
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert [c["index"] for c in calls] == list(range(len(calls)))
    return reasoning, content, _calls(calls), parser


@pytest.mark.parametrize("text,thinking,tools,want", CASES)
def test_full_reply(text, thinking, tools, want):
    parser = ReplyParser(thinking, tools)
    message = full_message(parser, text)
    reasoning, content, calls = want
    assert message.get("reasoning_content") == reasoning
    assert message["content"] == (content if content is not None or not (thinking or calls) else None)
    assert _calls(message.get("tool_calls")) == calls
    for c in message.get("tool_calls", []):
        assert c["type"] == "function" and c["id"].startswith("call_") and "index" not in c
    assert parser.finish_reason("stop") == ("tool_calls" if calls else "stop")
    assert parser.finish_reason("length") == "length"


@pytest.mark.parametrize("text,thinking,tools,want", CASES)
def test_streamed_reply_cut_at_every_character(text, thinking, tools, want):
    reasoning, content, calls = want
    for cut in range(len(text) + 1):
        got = _streamed(text, [cut], thinking, tools)
        assert got[:3] == (reasoning or "", content or "", calls), cut
    # and one character per delta
    assert _streamed(text, list(range(1, len(text))), thinking, tools)[:3] == (reasoning or "", content or "", calls)
