"""Offline decode throughput of LLM.generate vs transformers' generate, the GEMM floor, and the cost of
verification with oracle drafts.

    python examples/bench/bench_offline.py --model DIR [--batches 1,8,32] [--dtypes float32,bfloat16]
        [--weight-formats dense,packed] [--input-len 32] [--output-len 32] [--repeats 3]
        [--nextn 3 --oracle-drafts] [--runners eager,cpu_compiled] [--threads N] [--no-baseline] --out results/bench_offline.json

Each (dtype, weight format, batch) cell runs `--repeats` rounds; a round runs, back to back, the
engine's generate (ignore_eos, fixed lengths, greedy), the step's matmuls replayed alone, the oracle
engine's generate (with --oracle-drafts) and transformers' generate (V4 only: transformers has no
V4.1), so machine load hits every figure of a round alike. Every figure is the median over the
rounds, with its spread ((max - min) / median) next to it.

Per record:
- `tokens_per_s`: output tokens / wall time of the whole generate (prompt included: end to end);
  `decode_tokens_per_s`: batch / decode step time (transformers: from the time between its
  decode steps, stamped by a logits processor);
- `step_ms`: the engine's decode step (schedule + inputs + forward + sampling + outputs), the middle
  80 % of the steps averaged; `forward_ms` its forward; `overhead_frac` the rest's share;
- `gemm_floor_ms`: every aten mm/bmm/addmm/linear/einsum of one decode step at the same shapes,
  timed alone in the same round (examples/bench/gemm_floor.py); `step_over_floor` = step / floor;
- with `--nextn N --oracle-drafts` (a checkpoint with draft layers): a second engine with
  num_speculative_tokens = N whose drafts are the plain run's own continuation (deepinfer/spec/oracle_drafts.py:
  always accepted, no draft forward), so `verify_step_ms` is a step verifying N drafts a row and
  `verify_step_over_plain` its ratio to `step_ms`; `oracle_tokens_per_s_over_plain` compares end-to-end
  tokens/s and `oracle_tokens_equal_plain` checks the tokens (greedy: they must be equal);
- `speedup` / `decode_speedup`: engine / transformers tokens/s, end to end and decode;
- `runner`: the engine's runner strategy (`--runners eager,cpu_compiled` builds one engine each);
  `compile_s`: seconds its compiled regions took to build so far (paid once, at the cell's warm-up),
  `engine_build_s` the engine's construction.
Prints a table and writes JSON.
"""
import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from deepinfer import LLM, SamplingParams  # noqa: E402
from deepinfer.spec.oracle_drafts import oracle_drafts  # noqa: E402
from gemm_floor import MatmulReplay, recording_step  # noqa: E402


def _prompts(batch: int, input_len: int, vocab: int = 128000):
    g = torch.Generator().manual_seed(1234)
    return [[0] + torch.randint(3, vocab, (input_len - 1,), generator=g).tolist() for _ in range(batch)]


def _median_spread(values: list[float]) -> tuple[float, float]:
    med = statistics.median(values)
    return med, ((max(values) - min(values)) / med if med else 0.0)


def _trimmed_mean(xs: list[float]) -> float:
    xs = sorted(xs)
    cut = len(xs) // 10
    kept = xs[cut: max(cut + 1, len(xs) - cut)]
    return sum(kept) / len(kept)


def warm_up(llm: LLM, batch: int, input_len: int) -> None:
    """A short generate of the cell's own batch: a compiled runner builds the cell's bucket here."""
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in _prompts(batch, input_len)], params, use_tqdm=False)


def run_engine(llm: LLM, batch: int, input_len: int, output_len: int, rows_per_seq: int = 1) -> dict:
    """One measured generate: wall time, tokens, and the steps that ran every row as a decode row of
    `rows_per_seq` tokens (plain decode: 1; verification of n drafts: 1 + n)."""
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in _prompts(batch, input_len)]
    steps = []

    def hook(timing):
        if timing.num_prefill_tokens == 0 and timing.num_decode_tokens == batch * rows_per_seq:
            steps.append((timing.total_s, engine.worker.runner.last_timing.forward_s))

    engine.timing_hook = hook
    t0 = time.perf_counter()
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        engine.timing_hook = None
    elapsed = time.perf_counter() - t0
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    n_out = sum(len(t) for t in tokens)
    if n_out != batch * output_len:
        raise RuntimeError(f"expected {batch * output_len} output tokens, got {n_out}")
    return {"tokens_per_s": n_out / elapsed, "elapsed_s": elapsed, "tokens": tokens, "steps": len(steps),
            "step_s": _trimmed_mean([s for s, _ in steps]) if steps else float("nan"),
            "forward_s": _trimmed_mean([f for _, f in steps]) if steps else float("nan")}


def record_floor(llm: LLM, batch: int, input_len: int) -> MatmulReplay:
    """The matmuls of one decode step of `batch` rows past the prompt, ready to replay."""
    with recording_step(llm, lambda step: step.num_tokens >= batch and len(step.logits_indices) >= batch
                        and int(step.positions[:batch].min()) >= input_len) as captured:
        llm.generate([{"prompt_token_ids": p} for p in _prompts(batch, input_len)],
                     SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    return MatmulReplay(captured["calls"])


class _StepStamps:
    """A transformers logits processor that only stamps the time it is called (once per new token)."""

    def __init__(self):
        self.stamps = []

    def __call__(self, input_ids, scores):
        self.stamps.append(time.perf_counter())
        return scores


def load_transformers(model_dir: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    with torch.no_grad():
        model.generate(torch.tensor(_prompts(1, 8)), max_new_tokens=2, do_sample=False, min_new_tokens=2)
    return model


def run_transformers(model, batch: int, input_len: int, output_len: int) -> dict:
    from transformers import LogitsProcessorList
    ids = torch.tensor(_prompts(batch, input_len))
    stamps = _StepStamps()
    with torch.no_grad():
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False,
                             logits_processor=LogitsProcessorList([stamps]))
        elapsed = time.perf_counter() - t0
    n_out = (out.shape[1] - input_len) * batch
    s = stamps.stamps
    step_s = (s[-1] - s[0]) / (len(s) - 1) if len(s) > 1 else float("nan")
    return {"tokens_per_s": n_out / elapsed, "elapsed_s": elapsed, "step_s": step_s}


def measure_cell(llm, oracle_llm, hf_model, batch: int, args) -> dict:
    warm_up(llm, batch, args.input_len)
    floor = record_floor(llm, batch, args.input_len)
    if oracle_llm is not None:
        warm_up(oracle_llm, batch, args.input_len)
    rounds = []
    for _ in range(args.repeats):
        r = {"engine": run_engine(llm, batch, args.input_len, args.output_len), "floor_s": floor.time()}
        if oracle_llm is not None:
            plain = r["engine"]["tokens"]
            with oracle_drafts(oracle_llm, {tuple(p): t for p, t in zip(_prompts(batch, args.input_len), plain)}):
                r["oracle"] = run_engine(oracle_llm, batch, args.input_len, args.output_len, 1 + args.nextn)
        if hf_model is not None:
            r["transformers"] = run_transformers(hf_model, batch, args.input_len, args.output_len)
        rounds.append(r)
    return summarize(rounds, batch, len(floor.calls))


def summarize(rounds: list[dict], batch: int, num_matmuls: int) -> dict:
    def med(get):
        return _median_spread([get(r) for r in rounds])

    rec = {}
    tps, tps_spread = med(lambda r: r["engine"]["tokens_per_s"])
    step, step_spread = med(lambda r: r["engine"]["step_s"])
    fwd, _ = med(lambda r: r["engine"]["forward_s"])
    floor, floor_spread = med(lambda r: r["floor_s"])
    rec.update(tokens_per_s=tps, tokens_per_s_spread=tps_spread, decode_tokens_per_s=batch / step,
               step_ms=step * 1e3, step_ms_spread=step_spread, forward_ms=fwd * 1e3,
               overhead_frac=(step - fwd) / step, gemm_floor_ms=floor * 1e3, gemm_floor_ms_spread=floor_spread,
               step_over_floor=step / floor, num_matmuls_per_step=num_matmuls,
               step_over_floor_per_round=[r["engine"]["step_s"] / r["floor_s"] for r in rounds])
    if "oracle" in rounds[0]:
        v, v_spread = med(lambda r: r["oracle"]["step_s"])
        o_tps, o_spread = med(lambda r: r["oracle"]["tokens_per_s"])
        rec.update(verify_step_ms=v * 1e3, verify_step_ms_spread=v_spread, verify_step_over_plain=v / step,
                   verify_steps_per_round=[r["oracle"]["steps"] for r in rounds],
                   oracle_tokens_per_s=o_tps, oracle_tokens_per_s_spread=o_spread,
                   oracle_tokens_per_s_over_plain=o_tps / tps,
                   oracle_tokens_equal_plain=all(r["oracle"]["tokens"] == r["engine"]["tokens"] for r in rounds))
    if "transformers" in rounds[0]:
        h_tps, h_spread = med(lambda r: r["transformers"]["tokens_per_s"])
        h_step, _ = med(lambda r: r["transformers"]["step_s"])
        rec["transformers"] = {"tokens_per_s": h_tps, "tokens_per_s_spread": h_spread,
                               "decode_tokens_per_s": batch / h_step, "step_ms": h_step * 1e3}
        rec["speedup"] = tps / h_tps
        rec["decode_speedup"] = h_step / step
        # the ratio of each round, so its reproducibility is visible next to the median
        rec["speedup_per_round"] = [r["engine"]["tokens_per_s"] / r["transformers"]["tokens_per_s"] for r in rounds]
    return rec


def _line(rec: dict) -> str:
    s = (f"{rec['dtype']:9s} {rec['weight_format']:6s} {rec['runner']:12s} batch {rec['batch']:3d}: {rec['tokens_per_s']:8.1f} tok/s"
         f" (±{50 * rec['tokens_per_s_spread']:.0f}%)")
    if "speedup" in rec:
        s += f" | transformers {rec['transformers']['tokens_per_s']:8.1f} | x{rec['speedup']:.2f} e2e" \
             f" x{rec['decode_speedup']:.2f} decode"
    s += (f" | step {rec['step_ms']:6.1f} ms, GEMM floor {rec['gemm_floor_ms']:6.1f} ms"
          f" (x{rec['step_over_floor']:.2f}), overhead {100 * rec['overhead_frac']:4.1f}%")
    if "verify_step_ms" in rec:
        s += (f" | verify {rec['verify_step_ms']:6.1f} ms (x{rec['verify_step_over_plain']:.2f} plain),"
              f" oracle tok/s x{rec['oracle_tokens_per_s_over_plain']:.2f}"
              + ("" if rec["oracle_tokens_equal_plain"] else " TOKENS DIFFER"))
    return s


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3, help="rounds per cell; figures are medians over them")
    ap.add_argument("--nextn", type=int, default=0, help="drafts a row for --oracle-drafts")
    ap.add_argument("--oracle-drafts", action="store_true",
                    help="also measure verification of --nextn drafts that are always right")
    ap.add_argument("--no-baseline", action="store_true", help="skip the transformers baseline")
    ap.add_argument("--weight-formats", default="auto",
                    help="comma-separated: packed (checkpoint formats, dequantized in the GEMMs), dense, auto "
                         "(the platform's default)")
    ap.add_argument("--runners", default="platform",
                    help="comma-separated cpu runners, each an engine of its own: eager, cpu_compiled "
                         "(DEEPINFER_CPU_COMPILE), platform (the environment's choice)")
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: torch's default)")
    ap.add_argument("--out", default="results/bench_offline.json")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    if args.oracle_drafts and args.nextn < 1:
        ap.error("--oracle-drafts needs --nextn N >= 1")
    if args.nextn and not args.oracle_drafts:
        ap.error("--nextn is measured with --oracle-drafts only")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    cfg_type = json.load(open(os.path.join(args.model, "config.json"))).get("model_type")
    baseline = not args.no_baseline and cfg_type == "deepseek_v4"
    records = []
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        hf_model = load_transformers(args.model, dtype) if baseline else None
        for weight_format, runner in [(w, r) for w in args.weight_formats.split(",") for r in args.runners.split(",")]:
            if runner not in ("platform", "eager", "cpu_compiled"):
                raise SystemExit(f"--runners: expected platform, eager or cpu_compiled, got {runner!r}")
            if runner != "platform":   # read when the worker picks its runner (platforms/cpu.py)
                os.environ["DEEPINFER_CPU_COMPILE"] = "1" if runner == "cpu_compiled" else "0"
            kw = dict(model=args.model, dtype=dtype_name, max_model_len=args.input_len + args.output_len + 8,
                      max_num_seqs=max(batches), weight_format=weight_format)
            tokens = max(2048, max(batches) * args.input_len)
            t0 = time.perf_counter()
            llm = LLM(max_num_batched_tokens=tokens, **kw)
            build_s = time.perf_counter() - t0
            oracle_llm = None
            if args.oracle_drafts:
                oracle_llm = LLM(max_num_batched_tokens=tokens + max(batches) * args.nextn,
                                 num_speculative_tokens=args.nextn, **kw)
            resolved = llm.llm_engine.worker.weight_format
            strategy = llm.llm_engine.worker.runner.strategy
            for b in batches:
                rec = {"dtype": dtype_name, "weight_format": resolved, "batch": b, "input_len": args.input_len,
                       "output_len": args.output_len, "repeats": args.repeats, "nextn": args.nextn,
                       "runner": strategy.name, "engine_build_s": build_s,
                       # compiled prompt buckets (DEEPINFER_CPU_PREFILL_BUCKETS), none: prompt steps eager
                       "prefill_buckets": list(getattr(getattr(strategy, "buckets", None), "prefill_tokens", None) or [])}
                rec.update(measure_cell(llm, oracle_llm, hf_model, b, args))
                rec["compile_s"] = getattr(strategy, "compile_s", 0.0)   # compiled regions: paid once
                records.append(rec)
                print(_line(rec), flush=True)
            del llm, oracle_llm
        del hf_model
    meta = {"model": args.model, "model_type": cfg_type, "torch": torch.__version__,
            "threads": torch.get_num_threads(), "machine": platform.machine(),
            "load_average": os.getloadavg(), "records": records}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(meta, f, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
