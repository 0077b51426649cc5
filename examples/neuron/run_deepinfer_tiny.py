"""Run a tiny DeepSeek V4 / V4.1 checkpoint end to end on a platform and compare with the CPU platform.

    python examples/neuron/run_deepinfer_tiny.py --accelerator neuron            # host mode here
    python examples/neuron/run_deepinfer_tiny.py --accelerator neuron --kind v41 --max-tokens 12
    DEEPINFER_NEURON_FP8_GUARD=1 python examples/neuron/run_deepinfer_tiny.py --accelerator neuron

Generates the tiny checkpoints (real HF layout, fp8/fp4 weights, real tokenizer) into --ckpt-dir unless
they exist, loads each once, runs greedy generation through the LLM engine on the chosen platform
(Neuron: compiled layer regions, static buckets) and on the CPU platform (eager, the golden), and prints
the tokens, the golden comparison, the graphs compiled and, with the fp8 guard on, the unsafe float8
sites (load + run). Exit status 1 when tokens differ from the golden.
"""
import argparse
import contextlib
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

PROMPTS = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 5, 8,"]


def checkpoint(kind: str, root: Path) -> Path:
    from deepinfer.model_executor.tiny_checkpoint import make_tiny_checkpoint
    out = root / f"tiny-{kind}"
    if not (out / "config.json").exists():
        print(f"writing tiny {kind} checkpoint to {out} ...", flush=True)
        make_tiny_checkpoint(kind, out, seed=0)
    return out


def generate(engine_config, model_config, model, platform, prompts, max_tokens):
    from deepinfer import LLM, SamplingParams
    from deepinfer.engine.llm_engine import LLMEngine
    from deepinfer.worker.worker import Worker
    worker = Worker(model_config, engine_config, model=model, platform=platform)
    llm = LLM.from_engine(LLMEngine(engine_config, model_config=model_config, worker=worker))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], time.perf_counter() - t0, worker.runner.strategy


def run_kind(kind: str, args) -> bool:
    import torch

    from deepinfer.config import ModelConfig
    from deepinfer.engine_config import EngineConfig
    from deepinfer.model_executor.models.deepseek_v4 import DeepseekV4Model
    from deepinfer.platforms import current_platform, make_platform
    from deepinfer.worker.worker import build_model

    ckpt = Path(args.checkpoint) if args.checkpoint else checkpoint(kind, Path(args.ckpt_dir))
    model_config = ModelConfig.from_pretrained(ckpt)

    def engine_config(eager: bool):
        return EngineConfig(model=str(ckpt), dtype="float32", max_model_len=args.max_model_len,
                            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                            num_kv_blocks=args.num_kv_blocks, enforce_eager=eager).resolve(model_config)

    platform = current_platform()
    cpu = make_platform("cpu")
    guard = None
    if getattr(platform, "fp8_guard", False):
        from deepinfer.neuron_ops.fp8_guard import Fp8Guard
        guard = Fp8Guard()
    t0 = time.perf_counter()
    with guard if guard is not None else contextlib.nullcontext():
        golden_model = build_model(model_config, str(ckpt), torch.float32, progress=False, platform=cpu)
    load_s = time.perf_counter() - t0
    model = golden_model
    if platform.name != "cpu":
        # same weights, the platform's kernels (a second load would only repeat the dequantization)
        model = DeepseekV4Model(model_config, torch.float32, platform=platform)
        model.load_state_dict(golden_model.state_dict())
        model.post_load()
        model.eval().to(platform.device)

    tokens, run_s, runner = generate(engine_config(args.eager), model_config, model, platform, PROMPTS,
                                     args.max_tokens)
    golden, golden_s, _ = generate(engine_config(True), model_config, golden_model, cpu, PROMPTS, args.max_tokens)

    print(f"\n== {kind} ({ckpt}) on {platform!r}, load {load_s:.1f}s")
    ok = True
    for p, got, ref in zip(PROMPTS, tokens, golden):
        same = sum(a == b for a, b in zip(got, ref))
        ok &= got == ref
        print(f"  {p!r}\n    tokens {got}\n    golden {ref}  -> {same}/{len(ref)} match")
    print(f"  generate {run_s:.1f}s (golden CPU eager {golden_s:.1f}s)")
    regions = getattr(runner, "regions", None)
    if regions is not None:
        print(f"  region graphs compiled: {regions.stats.total_graphs} for {regions.num_kinds} layer kinds; "
              f"buckets (tokens, context): {sorted(runner.buckets_seen)}; eager steps: {runner.eager_steps}")
        if regions.stats.int64_sites:
            print(f"  int64 constants outside int32 in region graphs (docs/neuron.md §4 A4): "
                  f"{sorted(set(regions.stats.int64_sites))}")
    if guard is not None:
        sites = guard.report.lines() + runner.fp8_sites()
        print(f"  fp8 guard: {len(sites)} unsafe float8 sites (load + run)")
        for line in sites:
            print(f"    {line}")
    print(f"  golden match: {'yes' if ok else 'NO'}")
    return ok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--accelerator", choices=("cpu", "cuda", "neuron"), default="neuron")
    ap.add_argument("--kind", choices=("v4", "v41", "both"), default="both")
    ap.add_argument("--checkpoint", default=None, help="use this checkpoint instead of generating one")
    ap.add_argument("--ckpt-dir", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "deepinfer-tiny"))
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--max-model-len", type=int, default=256)
    ap.add_argument("--max-num-seqs", type=int, default=4)
    ap.add_argument("--max-num-batched-tokens", type=int, default=32,
                    help="also the Neuron prefill bucket unless DEEPINFER_NEURON_PREFILL_BUCKET is set")
    ap.add_argument("--num-kv-blocks", type=int, default=None)
    ap.add_argument("--eager", action="store_true", help="enforce_eager (no compiled graphs)")
    args = ap.parse_args(argv)
    os.environ["DEEPINFER_ACCELERATOR"] = args.accelerator   # before the platform resolves
    kinds = ("v4", "v41") if args.kind == "both" else (args.kind,)
    ok = all([run_kind(k, args) for k in kinds])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
