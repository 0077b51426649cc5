"""examples/neuron/distill_tiny_drafts.py: trains only the draft layers, deterministically for a seed,
and writes a checkpoint the engine loads (a few steps on a few short continuations here)."""
import os
import sys

import torch
from safetensors.torch import load_file

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples", "neuron"))
import distill_tiny_drafts  # noqa: E402

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
