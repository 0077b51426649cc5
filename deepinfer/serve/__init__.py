"""OpenAI-compatible HTTP server over deepinfer's LLMEngine (`python -m deepinfer.serve --model PATH`).

Files: cli.py (arguments, uvicorn), app.py (routes), completions.py / chat.py (the two generation
endpoints), protocol.py (request models), responses.py (response objects, SSE), engine_loop.py
(the engine thread and its asyncio bridge), generation.py (one HTTP request's engine requests),
chat_template.py (DeepSeek V4 chat format), metrics.py (Prometheus), middleware.py (API key, body
size), errors.py (OpenAI-shaped errors), state.py (server settings).
"""
