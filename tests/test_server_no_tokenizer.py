"""--skip-tokenizer-init on the server: token-id prompts are served, everything that needs text
(text prompts, chat, echo, logprobs token strings) is a 400 naming the field, never a 500."""
import asyncio

import httpx

from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.engine_config import EngineConfig
from serve.app import build_app
from serve.engine_loop import EngineLoop
from serve.metrics import ServerMetrics
from serve.state import ServerConfig, ServerState


def test_server_without_tokenizer_serves_token_ids_and_refuses_text(tiny_v4_dir):
    config = EngineConfig(model=str(tiny_v4_dir), dtype="float32", max_model_len=64, max_num_seqs=2,
                          max_num_batched_tokens=64, skip_tokenizer_init=True)

    async def scenario():
        state = ServerState(ServerConfig(served_model_name="m"),
                            EngineLoop(lambda: LLMEngine(config), ServerMetrics()))
        state.engine_loop.start(asyncio.get_running_loop())
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(build_app(state)),
                                         base_url="http://t", timeout=120) as c:
                for _ in range(1200):
                    if state.engine_loop.ready:
                        break
                    await asyncio.sleep(0.05)
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
        finally:
            state.engine_loop.stop()
        return ok, refused

    ok, refused = asyncio.run(scenario())
    assert ok.status_code == 200, ok.text
    assert ok.json()["usage"]["completion_tokens"] == 3
    for field, r in refused.items():
        assert r.status_code == 400, (field, r.status_code, r.text)
        err = r.json()["error"]
        assert err["param"] == field and "skip-tokenizer-init" in err["message"]
