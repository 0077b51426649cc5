"""Helpers of examples/neuron/bench_neuron.py: prompts, metrics, the three drivers (offline engine,
OpenAI server, transformers baseline) and the report (JSON, printed blocks, plot)."""
