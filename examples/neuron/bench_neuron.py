"""TTFT/TPOT matrix of deepinfer, offline (LLMEngine in-process) or against a running server.

    python examples/neuron/bench_neuron.py --model PATH --input-lens 128,512 --output-lens 32,128 \\
        --concurrency 1,4,16 [--num-prompts N] [--base-url http://127.0.0.1:8000] \\
        [--accelerator cpu|neuron] [--cp N] [--ep N] [--nextn 0,3,5] [--baseline transformers] \\
        --out results.json [--plot results.png]

Every (input, output, concurrency) cell sends random token-id prompts of exactly the input length
(distinct across the run) with ignore_eos and min_tokens = max_tokens = output length, as a closed
loop of `concurrency` requests in flight. Each cell is first warmed up with --num-warmups requests
of its own shape (default: one round of `concurrency`, two in server mode), which on Neuron
compiles the buckets the cell uses; the warm-up is not measured (offline records report any graph
compiled while measuring). Metrics use vLLM's definitions (bench_lib/metrics.py);
each cell prints vLLM's result block, the run ends with a summary matrix, and --out gets one JSON
record per cell. Offline mode builds the engine once, with max_num_seqs = the largest
concurrency. Server mode drives streaming /v1/completions; the server's lifecycle (and its
platform, buckets and max_model_len) is the caller's. --baseline transformers repeats the matrix
through transformers' generate (V4, dense weights) and reports deepinfer/transformers ratios.
--nextn is a sweep: offline, the matrix runs once per value with an engine built with
num_speculative_tokens = that value (DSpark drafts, V4.1 checkpoints with draft layers); each record
carries its nextn, the measured output tokens per decode step and, offline, the engine's draft
acceptance per depth. Server mode takes one value, the server's own --num-speculative-tokens.

--prompts-file FILE (JSON lines `{"prompt": ...}`, e.g. held-out prompts of docs/tiny_language.md from
examples/tiny_language.py) replaces the random prompts by the file's, in order and cycling.

Exit status: 0 when every request (warm-ups included) succeeded, 1 when any failed (they are
listed in the JSON), 2 for bad arguments.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)  # bench_lib
sys.path.insert(0, os.path.dirname(os.path.dirname(_HERE)))  # deepinfer, from a checkout

from bench_lib import report  # noqa: E402
from bench_lib.metrics import cell_metrics, speedup  # noqa: E402
from bench_lib.prompts import FilePrompts, PromptFactory  # noqa: E402


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _nonneg_int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected integers >= 0, got {text!r}")
    return values


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="checkpoint directory (server mode: for its vocabulary size)")
    ap.add_argument("--input-lens", type=_int_list, default=[128])
    ap.add_argument("--prompts-file", default=None,
                    help="JSON lines {\"prompt\": text or token ids}: the cells send these prompts (in file order, "
                         "cycling) instead of random ones; --input-lens is then ignored and records carry the "
                         "file's longest prompt as input_len")
    ap.add_argument("--output-lens", type=_int_list, default=[32])
    ap.add_argument("--concurrency", type=_int_list, default=[1])
    ap.add_argument("--num-prompts", type=int, default=None,
                    help="measured requests per cell (default: max(16, 4 x concurrency))")
    ap.add_argument("--num-warmups", type=int, default=None,
                    help="warm-up requests per cell, not measured (default: the cell's concurrency; "
                         "twice that in server mode)")
    ap.add_argument("--base-url", default=None, help="server mode: e.g. http://127.0.0.1:8000")
    ap.add_argument("--served-model-name", default=None, help="server mode (default: the first of /v1/models)")
    ap.add_argument("--api-key", default=None, help="server mode: sent as 'Authorization: Bearer KEY'")
    ap.add_argument("--request-timeout", type=float, default=3600.0,
                    help="server mode: seconds per request (Neuron compiles on first use)")
    ap.add_argument("--accelerator", choices=("cpu", "cuda", "neuron"), default=None,
                    help="offline: sets DEEPINFER_ACCELERATOR (neuron without a device = host mode); "
                         "server mode: only recorded (the server picked its platform)")
    ap.add_argument("--cp", type=int, default=1,
                    help="offline: context_parallel_size (ranks running one batch); server mode: only "
                         "recorded (pass --context-parallel-size to the server)")
    ap.add_argument("--ep", type=int, default=1,
                    help="offline: expert_parallel_size; server mode: only recorded (--expert-parallel-size)")
    ap.add_argument("--attention-tp-size", type=int, default=None,
                    help="offline: lane size of the head-sharded attention (default: min(cp, 8))")
    ap.add_argument("--nextn", type=_nonneg_int_list, default=[0],
                    help="speculative draft tokens per decode step, a comma list for a sweep (e.g. 0,3,5); "
                         "> 0 needs a V4.1 checkpoint with draft layers; server mode: one value, the "
                         "server's --num-speculative-tokens (recorded only)")
    ap.add_argument("--speculative-verify", choices=("all", "confidence"), default="all",
                    help="offline, with --nextn > 0: the engine's speculative_verify (which drafts a row "
                         "verifies; engine_config.py)")
    ap.add_argument("--draft-vocab", default=None,
                    help="offline, with --nextn > 0: the engine's speculative_draft_vocab, a JSON file of the "
                         "token ids drafts may take (examples/tools/build_draft_vocab.py)")
    ap.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto")
    ap.add_argument("--max-model-len", type=int, default=None, help="offline (default: max input + max output)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="offline; on Neuron also the prefill bucket (default: next power of two >= "
                         "max input + max concurrency)")
    ap.add_argument("--enforce-eager", action="store_true", help="offline: no graph runner")
    ap.add_argument("--warmup-graphs", action="store_true",
                    help="offline: build every bucket's graph when the engine starts (the engine's warmup_graphs), "
                         "so no measured request waits for a compile; the cell's warm-up requests alone may not "
                         "reach every row bucket a closed loop of --concurrency requests visits")
    ap.add_argument("--weight-format", choices=("auto", "packed", "dense"), default="auto",
                    help="offline: weights packed in their checkpoint formats or dequantized at load "
                         "(default: the platform's)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch intra-op threads for the offline engine and the baseline (default: torch's); "
                         "1 keeps numbers stable on a machine shared with other jobs")
    ap.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                    help="offline: the engine's automatic prefix caching; server mode: only recorded")
    ap.add_argument("--shared-prefix-len", type=int, default=0,
                    help="also measure prefix-cache reuse: after a warm-up request, two requests that share "
                         "a prefix of this many tokens (different --shared-suffix-len suffixes) run one after "
                         "the other; the JSON's shared_prefix record has both TTFTs and their ratio")
    ap.add_argument("--shared-suffix-len", type=int, default=16)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--baseline", choices=("transformers",), default=None)
    ap.add_argument("--out", required=True, help="JSON results")
    ap.add_argument("--plot", default=None, help="PNG of TTFT and TPOT against concurrency")
    args = ap.parse_args(argv)
    try:
        check_args(args)
    except ValueError as e:
        ap.error(str(e))
    return args


def check_args(args: argparse.Namespace) -> None:
    if args.cp < 1 or args.ep < 1:
        raise ValueError(f"--cp / --ep: must be >= 1, got {args.cp} / {args.ep}")
    big, small = max(args.cp, args.ep), min(args.cp, args.ep)
    if big % small:
        raise ValueError(f"--cp {args.cp} / --ep {args.ep}: the larger must be a multiple of the smaller")
    if args.base_url and len(args.nextn) != 1:
        raise ValueError(f"--nextn: server mode takes one value (the server's --num-speculative-tokens), "
                         f"got {args.nextn}")
    if args.num_prompts is not None and args.num_prompts < max(args.concurrency):
        raise ValueError(f"--num-prompts: must be >= the largest concurrency ({max(args.concurrency)}) so every "
                         f"cell reaches its concurrency, got {args.num_prompts}")
    if args.num_warmups is not None and args.num_warmups < 0:
        raise ValueError(f"--num-warmups: must be >= 0, got {args.num_warmups}")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads: must be >= 1, got {args.threads}")
    if args.shared_prefix_len < 0 or args.shared_suffix_len < 1:
        raise ValueError(f"--shared-prefix-len / --shared-suffix-len: must be >= 0 / >= 1, got "
                         f"{args.shared_prefix_len} / {args.shared_suffix_len}")
    if args.prompts_file is not None:
        if not os.path.isfile(args.prompts_file):
            raise ValueError(f"--prompts-file: {args.prompts_file} is not a file")
        if args.shared_prefix_len:
            raise ValueError("--prompts-file and --shared-prefix-len: the shared-prefix record makes its own prompts")
    if args.request_timeout <= 0:
        raise ValueError(f"--request-timeout: must be > 0, got {args.request_timeout}")
    config_path = os.path.join(args.model, "config.json")
    if not os.path.isfile(config_path):
        raise ValueError(f"--model: {args.model} has no config.json")
    if args.baseline == "transformers":  # before the matrix runs, not after
        with open(config_path) as f:
            model_type = json.load(f).get("model_type")
        if model_type != "deepseek_v4":
            raise ValueError(f"--baseline transformers: needs a V4 checkpoint (model_type deepseek_v4; "
                             f"transformers has no V4.1 model), got model_type {model_type!r}")
    if any(args.nextn):
        with open(config_path) as f:
            raw = json.load(f)
        text = raw.get("text_config", raw)
        if raw.get("model_type") != "deepseek_v41" or not text.get("num_nextn_predict_layers"):
            raise ValueError(f"--nextn {','.join(map(str, args.nextn))}: values > 0 need a deepseek_v41 checkpoint "
                             f"with draft layers (num_nextn_predict_layers > 0), got model_type "
                             f"{raw.get('model_type')!r}")


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def build_driver(args: argparse.Namespace, nextn: int = 0):
    """(driver, backend name, platform info) for deepinfer in the chosen mode."""
    if args.base_url:
        from bench_lib.server import ServerDriver
        driver = ServerDriver(args.base_url, args.served_model_name, args.api_key, args.request_timeout,
                              args.temperature, args.seed)
        platform = {"name": args.accelerator, "reported_by": "--accelerator flag (the server does not report it)",
                    "layout": {"cp": args.cp, "ep": args.ep,
                               "reported_by": "--cp / --ep flags (the server does not report its layout)"},
                    "server": driver.info()}
        return driver, "deepinfer-server", platform
    from bench_lib.offline import EngineArgs, OfflineDriver
    max_conc = max(args.concurrency)
    max_in = max(max(args.input_lens), shared_prompt_len(args))
    driver = OfflineDriver(EngineArgs(
        model=args.model, accelerator=args.accelerator, dtype=args.dtype,
        max_model_len=args.max_model_len or max_in + max(args.output_lens),
        max_num_seqs=max_conc,
        max_num_batched_tokens=(args.max_num_batched_tokens
                                or max(max_conc * (1 + nextn), _next_pow2(max_in + max_conc))),
        enable_prefix_caching=args.enable_prefix_caching,
        enforce_eager=args.enforce_eager, seed=args.seed, temperature=args.temperature,
        weight_format=args.weight_format, context_parallel_size=args.cp, expert_parallel_size=args.ep,
        attention_tp_size=args.attention_tp_size, num_speculative_tokens=nextn,
        speculative_verify=args.speculative_verify, speculative_draft_vocab=args.draft_vocab,
        warmup_graphs=args.warmup_graphs))
    return driver, "deepinfer-offline", driver.platform_info()


def run_matrix(driver, backend: str, args, prompts: PromptFactory, config: dict, platform: dict,
               versions: dict, nextn: int = 0) -> list[dict]:
    records = []
    for n_in in args.input_lens:
        for n_out in args.output_lens:
            for conc in args.concurrency:
                n = args.num_prompts or max(16, 4 * conc)
                n_warm = args.num_warmups
                if n_warm is None:
                    # In-process, one round of `conc` replays the cell's step shapes exactly; over HTTP,
                    # arrival jitter makes mixed prefill+decode steps the first round may not produce.
                    n_warm = conc if backend != "deepinfer-server" else 2 * conc
                offline = hasattr(driver, "step_buckets")
                graphs0 = getattr(driver, "num_graphs", None)
                warm = []
                if n_warm:
                    warm, _ = driver.run(prompts.make(n_warm, n_in, (n_out, conc, 0)), n_out, conc)
                    for r in warm:
                        r.check()
                if offline:
                    driver.step_buckets.clear()
                graphs1 = getattr(driver, "num_graphs", None)
                spec0 = driver.spec_stats() if hasattr(driver, "spec_stats") else None
                results, duration = driver.run(prompts.make(n, n_in, (n_out, conc, 1)), n_out, conc)
                rec = {"backend": backend, "input_len": n_in, "output_len": n_out, "concurrency": conc,
                       "nextn": nextn,
                       "num_prompts": n, "num_warmups": n_warm,
                       "warmup_failed": sum(not r.ok for r in warm),
                       "warmup_errors": [r.error for r in warm if not r.ok]}
                rec.update(cell_metrics(results, duration, conc))
                if spec0 is not None:
                    rec["spec_decode"] = spec_delta(spec0, driver.spec_stats())
                graphs2 = getattr(driver, "num_graphs", None)
                rec["buckets"] = {
                    # the server does not expose its buckets, only its graph count (/metrics)
                    "steps_per_bucket": dict(sorted(driver.step_buckets.items())) if offline else None,
                    "graphs_compiled_in_warmup": None if None in (graphs0, graphs1) else graphs1 - graphs0,
                    "graphs_compiled_while_measuring": None if None in (graphs1, graphs2) else graphs2 - graphs1}
                rec.update(config=config, platform=platform, versions=versions)
                records.append(rec)
                if backend != "transformers":
                    report.say(report.result_block(rec))
                else:
                    report.say(f"transformers in={n_in} out={n_out} c={conc}: "
                               f"TTFT {report.fmt(rec['mean_ttft_ms'])} ms, "
                               f"TPOT {report.fmt(rec['mean_tpot_ms'])} ms, failed {rec['failed']}")
    return records


def shared_prompt_len(args: argparse.Namespace) -> int:
    return args.shared_prefix_len + args.shared_suffix_len if args.shared_prefix_len else 0


def run_shared_prefix(driver, args, prompts: PromptFactory, nextn: int) -> dict:
    """TTFT of a request whose prompt shares --shared-prefix-len tokens with the one before it, against
    that first request's (both alone in the engine, after a warm-up request of the same length that
    shares nothing), with output length --output-lens' first value."""
    n_pre, n_suf, n_out = args.shared_prefix_len, args.shared_suffix_len, args.output_lens[0]
    warm, first, second = prompts.make(3, n_pre + n_suf, (n_pre, n_suf, nextn, 2))
    second = first[:n_pre] + second[n_pre:]
    hits = getattr(driver, "prefix_cache_hits", None)
    results = []
    for prompt in (warm, first, second):
        before = hits() if hits else None
        (r,), _ = driver.run([prompt], n_out, 1)
        r.check()
        results.append((r, None if hits is None else hits() - before))
    (rw, _), (r1, hit1), (r2, hit2) = results
    ok = rw.ok and r1.ok and r2.ok
    rec = {"shared_prefix_len": n_pre, "suffix_len": n_suf, "output_len": n_out, "nextn": nextn,
           "enable_prefix_caching": args.enable_prefix_caching,
           "ttft_first_ms": r1.ttft * 1e3 if ok else None, "ttft_second_ms": r2.ttft * 1e3 if ok else None,
           "ttft_ratio": r2.ttft / r1.ttft if ok else None,
           "cached_tokens_first": hit1, "cached_tokens_second": hit2,
           "failed": sum(not r.ok for r, _ in results), "errors": [r.error for r, _ in results if not r.ok]}
    report.say(f"shared prefix {n_pre} + {n_suf}: TTFT first {report.fmt(rec['ttft_first_ms'])} ms, second "
               f"{report.fmt(rec['ttft_second_ms'])} ms (ratio {report.fmt(rec['ttft_ratio'])}), cached "
               f"tokens {hit2}")
    return rec


def spec_delta(before, after) -> dict:
    """The engine's speculative-decoding counters over one cell (spec/stats.py)."""
    steps = after.num_decode_steps - before.num_decode_steps
    emitted = after.num_emitted_tokens - before.num_emitted_tokens
    ver = [a - (before.verified_at_depth[j] if j < len(before.verified_at_depth) else 0)
           for j, a in enumerate(after.verified_at_depth)]
    acc = [a - (before.accepted_at_depth[j] if j < len(before.accepted_at_depth) else 0)
           for j, a in enumerate(after.accepted_at_depth)]
    drafts = after.num_draft_tokens - before.num_draft_tokens
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    offered = after.num_offered_tokens - before.num_offered_tokens
    engine_steps = after.num_steps - before.num_steps
    conf_err = after.confidence_error_sum - before.confidence_error_sum
    return {"decode_request_steps": steps, "emitted_tokens": emitted,
            "offered_tokens": offered, "verify_steps": engine_steps,
            "verified_per_step": drafts / engine_steps if engine_steps else None,
            "confidence_error": conf_err / drafts if drafts else None,
            "tokens_per_decode_step": emitted / steps if steps else None,
            "draft_tokens": drafts, "accepted_tokens": accepted,
            "draft_accept_rate": accepted / drafts if drafts else None,
            "accept_rate_per_depth": [a / v if v else None for a, v in zip(acc, ver)]}


def main(argv=None) -> int:
    args = parse_args(argv)
    with open(os.path.join(args.model, "config.json")) as f:
        model_cfg = json.load(f)
    config = {k: v for k, v in vars(args).items() if k not in ("api_key",)}
    config["mode"] = "server" if args.base_url else "offline"
    config["model_type"] = model_cfg.get("model_type")
    versions = report.versions()
    if args.threads is not None:
        import torch
        torch.set_num_threads(args.threads)
    prompts = PromptFactory(int(model_cfg.get("vocab_size", 32000)), seed=args.seed)
    if args.prompts_file:
        try:
            prompts = FilePrompts.from_file(args.prompts_file, args.model)
        except (ValueError, FileNotFoundError) as e:
            print(f"error: --prompts-file: {e}", file=sys.stderr)
            return 2
        args.input_lens = [prompts.max_len]
        config["input_lens"] = args.input_lens

    records, shared = [], []
    for nextn in args.nextn:
        driver, backend, platform = build_driver(args, nextn)
        cfg = dict(config)
        if not args.base_url:
            cfg["engine"] = dataclasses.asdict(driver.args)
        records += run_matrix(driver, backend, args, prompts, cfg, platform, versions, nextn)
        if args.shared_prefix_len:
            shared.append(run_shared_prefix(driver, args, prompts, nextn))
        if hasattr(driver, "close"):
            driver.close()   # the offline engine's follower processes
        del driver

    base_records = []
    if args.baseline == "transformers":
        import gc
        gc.collect()
        from bench_lib.hf_baseline import TransformersDriver
        try:
            tf = TransformersDriver(args.model, args.dtype)
        except (ValueError, RuntimeError) as e:
            print(f"error: {e}", file=sys.stderr)
            report.write_json(args.out, {"records": records, "baseline_error": str(e)})
            return 2
        base_records = run_matrix(tf, "transformers", args, prompts, config, tf.info(), versions)
        for ours, base in zip(records, base_records * len(args.nextn)):
            ours["speedup_vs_transformers"] = s = speedup(ours, base)
            report.say(f"in={ours['input_len']} out={ours['output_len']} c={ours['concurrency']} deepinfer vs "
                       f"transformers (x, >1: deepinfer better): output tok/s {report.fmt(s['output_throughput'])}, "
                       f"TTFT {report.fmt(s['mean_ttft'])}, TPOT {report.fmt(s['mean_tpot'])}, "
                       f"E2EL {report.fmt(s['mean_e2el'])}")

    all_records = records + base_records
    report.say(report.summary_matrix(all_records))
    failed = sum(r["failed"] + r["warmup_failed"] for r in all_records) + sum(r["failed"] for r in shared)
    out = {"records": all_records, "failed_requests": failed}
    if shared:
        out["shared_prefix"] = shared
    report.write_json(args.out, out)
    report.say(f"wrote {args.out}")
    if args.plot:
        report.plot(args.plot, all_records)
        report.say(f"wrote {args.plot}")
    if failed:
        errors = [e for r in all_records for e in r["warmup_errors"] + r["errors"]]
        errors += [e for r in shared for e in r["errors"]]
        print(f"error: {failed} request(s) failed (warm-ups included); first: {errors[0]}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
