"""Offline decode throughput of LLM.generate vs transformers' generate, plus the GEMM floor.

    python examples/bench/bench_offline.py --model DIR [--batches 1,8,32] [--dtypes float32,bfloat16]
        [--weight-formats dense,packed]
        [--input-len 32] [--output-len 32] [--no-baseline] --out results/bench_offline.json

For each (dtype, batch): output tokens/s of deepinfer (ignore_eos, fixed lengths) and of
transformers on the same checkpoint (V4 only: transformers has no V4.1), the ratio, the engine's
mean decode step time, that step's matmuls replayed alone (the GEMM-bound floor: every aten
mm/bmm/addmm of one decode step, recorded with a dispatch mode and timed in isolation), and the
engine overhead (schedule + input preparation + sampling + output handling) as a fraction of
the step. Prints a table and writes JSON.
"""
import argparse
import json
import os
import platform
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from deepinfer import LLM, SamplingParams  # noqa: E402

# In inference mode matmul / einsum / linear reach the dispatch mode undecomposed, so record them too.
_MM_OPS = {torch.ops.aten.mm.default, torch.ops.aten.bmm.default, torch.ops.aten.addmm.default,
           torch.ops.aten.matmul.default, torch.ops.aten.einsum.default, torch.ops.aten.linear.default}


def _spec(a):
    if isinstance(a, torch.Tensor):
        return ("tensor", tuple(a.shape), tuple(a.stride()), a.dtype)
    if isinstance(a, (list, tuple)) and a and all(isinstance(t, torch.Tensor) for t in a):
        return ("list", [_spec(t) for t in a])
    return ("value", a)


def _build(spec):
    """A random tensor with the recorded shape, strides (transposed weights stay transposed) and dtype."""
    kind = spec[0]
    if kind == "tensor":
        _, shape, stride, dtype = spec
        size = 1 + sum((n - 1) * st for n, st in zip(shape, stride) if n > 0)
        return torch.randn(size, dtype=torch.float32).to(dtype).as_strided(shape, stride)
    if kind == "list":
        return [_build(t) for t in spec[1]]
    return spec[1]


class _RecordMatmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _MM_OPS:
            self.calls.append((func, [_spec(a) for a in args]))
        return func(*args, **(kwargs or {}))


def _time_matmuls(calls, reps: int = 20) -> float:
    """Seconds for running every recorded matmul once, on fresh random operands."""
    prepared = []
    for func, args in calls:
        prepared.append((func, [_build(a) for a in args]))
    for func, args in prepared:
        func(*args)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(reps):
            for func, args in prepared:
                func(*args)
        best = min(best, (time.perf_counter() - t0) / reps)
    return best


def _prompts(batch: int, input_len: int, vocab: int = 128000):
    g = torch.Generator().manual_seed(1234)
    return [[0] + torch.randint(3, vocab, (input_len - 1,), generator=g).tolist() for _ in range(batch)]


def bench_engine(llm: LLM, batch: int, input_len: int, output_len: int) -> dict:
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in _prompts(batch, input_len)]
    llm.generate(prompts[: min(batch, 2)], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
                 use_tqdm=False)  # warm-up
    decode_steps = []

    def hook(timing):
        if timing.num_prefill_tokens == 0 and timing.num_decode_tokens == batch:
            w = engine.worker
            decode_steps.append((timing.total_s, w.runner.last_timing.forward_s))

    engine.timing_hook = hook
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    engine.timing_hook = None
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    assert n_out == batch * output_len, f"expected {batch * output_len} output tokens, got {n_out}"
    steps = sorted(decode_steps)[len(decode_steps) // 10: max(1, len(decode_steps) - len(decode_steps) // 10)]
    step_s = sum(s for s, _ in steps) / len(steps)
    fwd_s = sum(f for _, f in steps) / len(steps)

    # the GEMM floor of one decode step at this batch: record the step's matmuls, replay them alone
    rec = _RecordMatmuls()
    seqs_prompts = [{"prompt_token_ids": p} for p in _prompts(batch, input_len)]
    captured = {}
    worker = engine.worker
    strategy = worker.runner.strategy
    orig_forward = strategy.forward

    def recording_forward(step, cache, bucket):
        if step.num_tokens == batch and "calls" not in captured and int(step.positions.min()) >= input_len:
            with rec:
                out = orig_forward(step, cache, bucket)
            captured["calls"] = list(rec.calls)
            return out
        return orig_forward(step, cache, bucket)

    strategy.forward = recording_forward
    try:
        llm.generate(seqs_prompts, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    finally:
        strategy.forward = orig_forward
    floor_s = _time_matmuls(captured["calls"])
    return {"tokens_per_s": n_out / elapsed, "elapsed_s": elapsed, "decode_step_s": step_s,
            "forward_s": fwd_s, "overhead_frac": (step_s - fwd_s) / step_s,
            "gemm_floor_s": floor_s, "step_over_floor": step_s / floor_s,
            "num_matmuls_per_step": len(captured["calls"])}


def bench_transformers(model_dir: str, dtype: torch.dtype, batch: int, input_len: int, output_len: int) -> dict:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    ids = torch.tensor(_prompts(batch, input_len))
    with torch.no_grad():
        model.generate(ids[:, :8], max_new_tokens=2, do_sample=False, min_new_tokens=2)
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False)
        elapsed = time.perf_counter() - t0
    n_out = (out.shape[1] - input_len) * batch
    return {"tokens_per_s": n_out / elapsed, "elapsed_s": elapsed}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--no-baseline", action="store_true", help="skip the transformers baseline")
    ap.add_argument("--weight-formats", default="auto",
                    help="comma-separated: packed (checkpoint formats, dequantized in the GEMMs), dense, auto "
                         "(the platform's default)")
    ap.add_argument("--out", default="results/bench_offline.json")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    cfg_type = json.load(open(os.path.join(args.model, "config.json"))).get("model_type")
    baseline = not args.no_baseline and cfg_type == "deepseek_v4"
    records = []
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        hf = {}   # transformers does not depend on our weight format: measured once per batch
        for weight_format in args.weight_formats.split(","):
            llm = LLM(model=args.model, dtype=dtype_name, max_model_len=args.input_len + args.output_len + 8,
                      max_num_seqs=max(batches), max_num_batched_tokens=max(2048, max(batches) * args.input_len),
                      weight_format=weight_format)
            resolved = llm.llm_engine.worker.weight_format
            for b in batches:
                rec = {"dtype": dtype_name, "weight_format": resolved, "batch": b, "input_len": args.input_len,
                       "output_len": args.output_len, "engine": bench_engine(llm, b, args.input_len, args.output_len)}
                if baseline:
                    if b not in hf:
                        hf[b] = bench_transformers(args.model, dtype, b, args.input_len, args.output_len)
                    rec["transformers"] = hf[b]
                    rec["speedup"] = rec["engine"]["tokens_per_s"] / rec["transformers"]["tokens_per_s"]
                records.append(rec)
                e = rec["engine"]
                print(f"{dtype_name:9s} {resolved:6s} batch {b:3d}: engine {e['tokens_per_s']:8.1f} tok/s"
                      + (f" | transformers {rec['transformers']['tokens_per_s']:8.1f} tok/s | x{rec['speedup']:.2f}"
                         if baseline else "")
                      + f" | step {e['decode_step_s'] * 1e3:6.1f} ms, GEMM floor {e['gemm_floor_s'] * 1e3:6.1f} ms"
                      f" (x{e['step_over_floor']:.2f}), overhead {100 * e['overhead_frac']:4.1f}%", flush=True)
            del llm
    meta = {"model": args.model, "model_type": cfg_type, "torch": torch.__version__,
            "threads": torch.get_num_threads(), "machine": platform.machine(), "records": records}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(meta, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
