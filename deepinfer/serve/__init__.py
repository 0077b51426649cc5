"""OpenAI-compatible HTTP server over deepinfer's LLMEngine (`python -m deepinfer.serve --model PATH`).

Files: cli.py (arguments, uvicorn), app.py (routes), completions.py / chat.py (the two generation
endpoints), protocol.py (request models), responses.py (response objects, SSE), engine_loop.py
(the engine thread and its asyncio bridge), generation.py (one HTTP request's engine requests),
chat_template.py (DeepSeek V4 chat format), dsml.py (its tool markup), tool_choice.py (tools,
tool_choice, the forced-call grammar), reply_parser.py with reasoning.py and tool_calls.py (a reply's
reasoning_content, content and tool_calls), metrics.py (Prometheus), middleware.py (API key, body
size), errors.py (OpenAI-shaped errors), state.py (server settings).
"""
