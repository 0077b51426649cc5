"""examples/tools/distill_tiny_drafts.py: trains only the draft layers, deterministically for a seed,
and writes a checkpoint the engine loads (a few steps on a few short continuations here)."""
import torch
from safetensors.torch import load_file

from tests.support import load_script

distill_tiny_drafts = load_script("examples/tools/distill_tiny_drafts.py")

ARGS = ["--prompts", "2", "--prompt-len", "6", "--gen-len", "8", "--steps", "2", "--batch", "4", "--blocks", "2",
        "--heldout", "2", "--eval-anchors", "8"]


def test_distillation_changes_only_draft_tensors_and_is_deterministic(tiny_v41_dir, tmp_path):
    outs = [tmp_path / "a", tmp_path / "b"]
    for out in outs:
        assert distill_tiny_drafts.main(["--model", str(tiny_v41_dir), "--out", str(out), *ARGS]) == 0
    before = load_file(str(tiny_v41_dir / "model.safetensors"))
    a, b = (load_file(str(o / "model.safetensors")) for o in outs)
    assert set(a) == set(before) == set(b)
    changed = {k for k in a if not torch.equal(a[k].view(torch.uint8) if a[k].dtype != torch.int64 else a[k],
                                               before[k].view(torch.uint8) if before[k].dtype != torch.int64
                                               else before[k])}
    assert changed and all(k.startswith("mtp.") for k in changed)
    assert all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a if a[k].dtype != torch.int64)
    assert (outs[0] / "distill_report.json").is_file()


def test_speculative_greedy_with_a_distilled_draft_equals_plain_greedy(tiny_v41_dir, tmp_path):
    """A draft distilled on two continuations memorises them, so replaying their prompts its drafts
    are accepted (not oracle drafts: the draft layers' own forward, sampled by the engine); greedy
    with drafts still emits exactly the plain greedy tokens."""
    from deepinfer import LLM, SamplingParams
    out = tmp_path / "distilled"
    args = ["--prompts", "2", "--prompt-len", "6", "--gen-len", "16", "--steps", "15", "--batch", "16",
            "--blocks", "3", "--lr", "5e-3", "--heldout", "2", "--eval-anchors", "8"]
    assert distill_tiny_drafts.main(["--model", str(tiny_v41_dir), "--out", str(out), *args]) == 0
    prompts = [{"prompt_token_ids": p} for p in distill_tiny_drafts.training_prompts(0, 2, 6, 129280)]
    params = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    engine = dict(dtype="float32", max_model_len=64, max_num_seqs=2, enforce_eager=True, skip_tokenizer_init=True)
    with LLM(str(out), **engine) as llm:
        plain = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    with LLM(str(out), **engine, num_speculative_tokens=3) as llm:
        spec = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
        stats = llm.llm_engine.scheduler.spec_policy.stats
    assert spec == plain
    print(f"distilled draft: {stats.tokens_per_step:.2f} tokens per step, accept rates {stats.accept_rates}")
    assert stats.num_accepted_tokens > 0 and stats.tokens_per_step > 1.2, stats
