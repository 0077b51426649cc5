"""Baseline: the same cells through transformers' `generate` on the same checkpoint (V4 only;
transformers has DeepseekV4ForCausalLM but nothing for V4.1).

What is measured: `generate` has no continuous batching, so a cell with concurrency C runs its
prompts as consecutive static batches of C (the last one may be smaller), greedy, with
min_new_tokens = max_new_tokens = output_len (EOS cannot end a row early). A streamer stamps the
time each decode step hands its tokens out. For every request of a batch: TTFT = first new token
of the batch - batch start, ITL = the gaps between steps, E2EL = last token - batch start. At
concurrency 1 this is exactly per-request streaming; above it, every row of a batch shares its
batch's timings.
"""
from __future__ import annotations

import json
import os
import time

import torch

from bench_lib.metrics import RequestResult

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class _StepClock:
    """A generate() streamer that records when each decode step's tokens arrive."""

    def __init__(self):
        self.times: list[float] = []
        self._got_prompt = False

    def put(self, value) -> None:
        if not self._got_prompt:  # generate() first puts the prompt itself
            self._got_prompt = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


class TransformersDriver:
    def __init__(self, model_dir: str, dtype: str):
        with open(os.path.join(model_dir, "config.json")) as f:
            model_type = json.load(f).get("model_type")
        if model_type != "deepseek_v4":
            raise ValueError(f"--baseline transformers: needs a V4 checkpoint (model_type deepseek_v4; "
                             f"transformers has no V4.1 model), got model_type {model_type!r}")
        from transformers import AutoModelForCausalLM
        kwargs = {} if dtype == "auto" else {"dtype": _DTYPES[dtype]}
        t0 = time.perf_counter()
        try:
            self.model = AutoModelForCausalLM.from_pretrained(model_dir, **kwargs).eval()
        except Exception as e:  # noqa: BLE001 - re-raised with the likely cause
            raise RuntimeError(f"--baseline transformers: transformers could not load {model_dir} ({e!r}); "
                               f"it needs dense weights (make_tiny_checkpoint.py --unquantized)") from e
        self.load_s = time.perf_counter() - t0
        self.dtype = str(next(self.model.parameters()).dtype).replace("torch.", "")

    def info(self) -> dict:
        import transformers
        return {"name": "transformers", "model_class": type(self.model).__name__, "dtype": self.dtype,
                "transformers": transformers.__version__, "model_load_s": self.load_s,
                "torch_threads": torch.get_num_threads(),
                "method": "static batches of `concurrency` prompts through generate(); see hf_baseline.py"}

    @torch.inference_mode()
    def run(self, prompts: list[list[int]], output_len: int, concurrency: int) -> tuple[list[RequestResult], float]:
        results = [RequestResult(len(p), output_len) for p in prompts]
        t0 = time.perf_counter()
        for i in range(0, len(prompts), concurrency):
            self._batch(prompts[i:i + concurrency], results[i:i + concurrency], output_len)
        return results, time.perf_counter() - t0

    def _batch(self, prompts, results, output_len) -> None:
        # Same-length rows: no padding, an all-ones attention mask.
        ids = torch.tensor(prompts, dtype=torch.long)
        clock = _StepClock()
        start = time.perf_counter()
        for r in results:
            r.start = start
        try:
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                      max_new_tokens=output_len, min_new_tokens=output_len,
                                      pad_token_id=0, streamer=clock)
        except Exception as e:  # noqa: BLE001 - counted as failed requests
            for r in results:
                r.fail(f"transformers generate failed: {e!r}")
                r.end = time.perf_counter()
            return
        end = time.perf_counter()
        for r in results:
            r.token_times = list(clock.times)
            r.output_len = int(out.shape[1] - ids.shape[1])
            r.end = end
