"""--skip-tokenizer-init on the server: token-id prompts are served, everything that needs text
(text prompts, chat, echo, logprobs token strings) is a 400 naming the field, never a 500."""
import asyncio

from deepinfer.engine_config import EngineConfig
from tests.support.server import in_process_app


def test_server_without_tokenizer_serves_token_ids_and_refuses_text(tiny_v4_dir):
    config = EngineConfig(model=str(tiny_v4_dir), dtype="float32", max_model_len=64, max_num_seqs=2,
                          max_num_batched_tokens=64, skip_tokenizer_init=True)

    async def scenario():
        async with in_process_app(config, "m", timeout=120) as (c, _):
            ok = await c.post("/v1/completions", json={"prompt": [0, 5, 6, 7], "max_tokens": 3,
                                                       "temperature": 0})
            refused = {
                "prompt": await c.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2}),
                "echo": await c.post("/v1/completions", json={"prompt": [0, 5], "echo": True,
                                                              "max_tokens": 2}),
                "logprobs": await c.post("/v1/completions", json={"prompt": [0, 5], "logprobs": 1,
                                                                  "max_tokens": 2}),
                "messages": await c.post("/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
            }
        return ok, refused

    ok, refused = asyncio.run(scenario())
    assert ok.status_code == 200, ok.text
    assert ok.json()["usage"]["completion_tokens"] == 3
    for field, r in refused.items():
        assert r.status_code == 400, (field, r.status_code, r.text)
        err = r.json()["error"]
        assert err["param"] == field and "skip-tokenizer-init" in err["message"]
