"""The --reasoning-parser server option: deepseek_v4 (default) splits thinking-mode replies into
reasoning_content and content; none answers the raw text as content. The real app and a tiny
engine in process."""

from __future__ import annotations

import asyncio

import pytest

from deepinfer.engine_config import EngineConfig
from deepinfer.serve import cli as serve_cli
from tests.support.server import in_process_app

THINKING = {"messages": [{"role": "user", "content": "2+2?"}], "max_tokens": 5, "temperature": 0,
            "chat_template_kwargs": {"thinking": True}}


def test_option_parses_to_the_server_config(tiny_v4_dir):
    default = serve_cli.parse_args(["--model", str(tiny_v4_dir)])
    assert default.reasoning_parser == "deepseek_v4"
    assert serve_cli._configs(default)[1].reasoning_parser == "deepseek_v4"
    off = serve_cli.parse_args(["--model", str(tiny_v4_dir), "--reasoning-parser", "none"])
    assert serve_cli._configs(off)[1].reasoning_parser is None
    with pytest.raises(SystemExit):
        serve_cli.parse_args(["--model", str(tiny_v4_dir), "--reasoning-parser", "qwen3"])


def test_parser_off_answers_the_raw_text(tiny_v4_dir):
    config = EngineConfig(model=str(tiny_v4_dir), dtype="float32", max_model_len=64, max_num_seqs=2,
                          max_num_batched_tokens=64)

    async def scenario():
        async with in_process_app(config, "m", timeout=120) as (c, state):
            parsed = (await c.post("/v1/chat/completions", json=THINKING)).json()
            state.config.reasoning_parser = None
            raw = (await c.post("/v1/chat/completions", json=THINKING)).json()
            chat_mode = (await c.post("/v1/chat/completions",
                                      json={**THINKING, "chat_template_kwargs": {}})).json()
        return parsed, raw, chat_mode

    parsed, raw, chat_mode = asyncio.run(scenario())
    parsed_msg, raw_msg = parsed["choices"][0]["message"], raw["choices"][0]["message"]
    assert "reasoning_content" not in raw_msg and "reasoning_content" not in chat_mode["choices"][0]["message"]
    text = raw_msg["content"]
    if "</think>" in text:
        assert parsed_msg["reasoning_content"] + "</think>" + (parsed_msg["content"] or "") == text
    else:
        assert parsed_msg == {"role": "assistant", "reasoning_content": text, "content": None}
        assert parsed["choices"][0]["finish_reason"] == "length"
