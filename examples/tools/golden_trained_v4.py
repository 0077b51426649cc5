"""The golden V4 check (tests/engine/test_golden_v4.py's logic) on a trained V4 checkpoint:
this engine's greedy answers to held-out prompts of docs/tiny_language.md against transformers'.

    python examples/tools/golden_trained_v4.py --model checkpoints/trained-v4 [--n 8] [--tokens 8]

The trained checkpoint is fp8 128x128 blocks with fp4 experts. This engine loads it as is; for
transformers (which reads dense V4 weights, as in the golden test) the script writes its dense copy:
every tensor dequantized exactly as the engine's loader does, stored in fp32 under the same names,
without the quantization config. Both therefore compute with the same values. Reports per prompt
whether the generated token ids are equal, the max |logit difference| of the prompt's logits, and
whether each answer is right. Exit status 1 when any prompt's tokens differ.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(_HERE)))  # deepinfer (and tests.support), from a checkout
sys.path.insert(0, os.path.dirname(_HERE))                   # tiny_language

import torch  # noqa: E402

import tiny_language as lang  # noqa: E402


def write_dense_copy(model, raw: dict, out: str) -> None:
    """The checkpoint of the loaded (dequantized) `model` in fp32, without quantization."""
    from deepinfer.model_executor.tiny_checkpoint import write_checkpoint
    dense = copy.deepcopy(raw)
    dense.pop("quantization_config", None)
    dense["dtype"] = "float32"
    state = {k: v.detach() for k, v in model.state_dict().items()}
    write_checkpoint(dense, out, lambda cfg, name, shape: state[name].reshape(shape).clone(), dtype="float32")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="trained V4 checkpoint (examples/train_tiny.py --kind v4)")
    ap.add_argument("--n", type=int, default=8, help="held-out prompts of count, copy and lookup each")
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    from deepinfer.config import ModelConfig
    from deepinfer.tokenizer import load_tokenizer
    from deepinfer.worker.worker import build_model
    from tests.support.model_helpers import run_chunks
    raw = json.loads(open(os.path.join(args.model, "config.json")).read())
    if raw.get("model_type") != "deepseek_v4":
        ap.error(f"--model: needs a deepseek_v4 checkpoint, got {raw.get('model_type')!r}")
    cfg = ModelConfig.from_pretrained(args.model)
    ours = build_model(cfg, args.model, torch.float32, progress=False)
    tok = load_tokenizer(args.model)
    with tempfile.TemporaryDirectory(prefix="trained-v4-dense-") as dense_dir:
        write_dense_copy(ours, raw, dense_dir)
        tf = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.float32).eval()
    prompts = [p for kind in ("count", "copy", "lookup") for p in lang.heldout_prompts(kind, args.n, args.seed)]
    equal = right_ours = right_tf = 0
    worst = 0.0
    for p in prompts:
        ids = tok.encode(p.prompt)
        with torch.no_grad():
            ref_logits = tf(torch.tensor([ids])).logits[0].float()
            ref = tf.generate(torch.tensor([ids]), max_new_tokens=args.tokens, do_sample=False)[0, len(ids):].tolist()
        got_logits = run_chunks(ours, ids, [len(ids)])
        worst = max(worst, float((got_logits - ref_logits).abs().max()))
        toks = list(ids)
        for _ in range(args.tokens):
            toks.append(int(run_chunks(ours, toks, [len(toks)])[-1].argmax()))
        got = toks[len(ids):]
        equal += got == ref
        right_ours += p.correct(tok.decode(got))
        right_tf += p.correct(tok.decode(ref))
        print(f"[{p.kind}] equal={got == ref} ours={tok.decode(got)!r} transformers={tok.decode(ref)!r} "
              f"expected={p.answer!r}")
    print(f"{equal} of {len(prompts)} prompts: the same {args.tokens} greedy tokens as transformers; "
          f"max |logit difference| over the prompts {worst:.2e}; right: deepinfer {right_ours}, "
          f"transformers {right_tf} of {len(prompts)}")
    return 0 if equal == len(prompts) else 1


if __name__ == "__main__":
    sys.exit(main())
