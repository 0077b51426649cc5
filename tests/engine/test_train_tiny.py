"""examples/train_tiny.py end to end at a few steps: it trains through the engine's forward, writes
a checkpoint the engine loads in the real layout (fp8 blocks, fp4 experts, bf16 embedding / head,
the real vocabulary), its compact artifact expands back to exactly that checkpoint, and speculative
greedy decoding with the distilled draft layers emits the plain greedy tokens."""
import json
import random

import pytest
import torch
from safetensors import safe_open

from deepinfer import LLM, SamplingParams
from tests.support import load_script

train_tiny = load_script("examples/train_tiny.py")
artifact = load_script("examples/tools/trained_artifact.py")
lang = load_script("examples/tiny_language.py")


def _tensors(d):
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            out.update({k: fh.get_tensor(k) for k in fh.keys()})
    return out


def test_train_write_expand_load_and_speculate(tmp_path):
    out, art = tmp_path / "trained", tmp_path / "trained.safetensors"
    assert train_tiny.main(["--kind", "v41", "--out", str(out), "--artifact", str(art), "--steps", "2",
                            "--batch", "2", "--seq-len", "48", "--draft-steps", "2", "--draft-batch", "4"]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"]["expert_dtype"] == "fp4" and cfg["text_config"]["vocab_size"] == 129280
    stored = _tensors(out)
    assert stored["layers.1.ffn.experts.0.w1.weight"].dtype == torch.int8          # fp4 codes
    assert stored["layers.1.attn.wq_a.weight"].dtype == torch.float8_e4m3fn        # fp8 blocks
    assert stored["embed.weight"].dtype == torch.bfloat16 and stored["embed.weight"].shape[0] == 129280
    assert art.stat().st_size < 10 * 2**20

    expanded = artifact.expand_artifact(art, tmp_path / "expanded")
    again = _tensors(expanded)
    assert sorted(again) == sorted(stored)
    for k, t in stored.items():
        assert torch.equal(again[k].view(torch.uint8), t.view(torch.uint8)), k

    prompts = [p.prompt for kind in ("count", "copy") for p in lang.heldout_prompts(kind, 2, seed=3)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    tokens = {}
    for nextn in (0, 3):
        llm = LLM(model=str(expanded), dtype="float32", max_model_len=96, max_num_seqs=4,
                  num_speculative_tokens=nextn)
        tokens[nextn] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        llm.close()
    assert tokens[3] == tokens[0]


def test_training_batches_weigh_the_determined_tokens():
    tok = train_tiny.load_tokenizer()
    kinds: list = []
    batch = train_tiny.training_batch(tok, random.Random(0), 3, 128, kinds)
    assert batch == train_tiny.training_batch(tok, random.Random(0), 3, 128)
    for (ids, weights), kind in zip(batch, kinds):
        assert ids[0] == train_tiny.BOS and len(ids) == len(weights) == len(kind) == 129
        assert set(weights) == {train_tiny.FREE_WEIGHT, 1.0}
        # a determined token carries its line's kind, a free one none
        assert all((w == 1.0) == (k >= 0) for w, k in zip(weights, kind))
    used = set(train_tiny.language_token_ids(tok))
    assert all(t in used for ids, _ in batch for t in ids)
    for kind in lang.KINDS[:3]:
        free, fixed = train_tiny.line_parts(random.Random(1), kind)
        assert tok.encode(free + fixed).ids == tok.encode(free).ids + tok.encode(fixed).ids


def test_main_from_distils_the_drafts_and_keeps_the_main_model_byte_for_byte(tmp_path):
    """--main-from: the second stage of the committed artifact's recipe (docs/tiny_language.md §4)
    trains only the draft layers, so every other stored tensor is the source checkpoint's exactly."""
    first, second = tmp_path / "first", tmp_path / "second"
    common = ["--kind", "v41", "--batch", "2", "--seq-len", "48", "--draft-batch", "4", "--draft-docs", "4"]
    assert train_tiny.main(common + ["--out", str(first), "--steps", "1", "--draft-steps", "1"]) == 0
    assert train_tiny.main(common + ["--out", str(second), "--main-from", str(first), "--draft-steps", "2",
                                     "--draft-hidden-weight", "1"]) == 0
    a, b = _tensors(first), _tensors(second)
    assert sorted(a) == sorted(b)
    changed = {k for k in a if not torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8))}
    assert changed and all(k.startswith("mtp.") for k in changed), sorted(changed)[:5]


def test_draft_anchors_mostly_score_determined_tokens():
    tok = train_tiny.load_tokenizer()
    docs = train_tiny.training_batch(tok, random.Random(2), 16, 96)
    seqs, weights = [s for s, _ in docs], [w for _, w in docs]
    anchors = train_tiny.determined_anchors(seqs, weights, 3, 400, torch.Generator().manual_seed(0))
    assert all(0 <= a and a + 3 + 1 < len(seqs[i]) for i, a in anchors)
    share = sum(weights[i][a + 2] == 1.0 for i, a in anchors) / len(anchors)
    everywhere = sum(w[a + 2] == 1.0 for w in weights for a in range(len(w) - 4)) / sum(len(w) - 4 for w in weights)
    assert share > 2 * everywhere and share > 0.6, (share, everywhere)


def test_data_mix_and_its_second_phase():
    """--shares / --short-lookup-* / --lookup-weight shape the documents, and from --phase2-from on the
    --phase2-* mix does (the lookup experiments of docs/tiny_language.md §6)."""
    tok = train_tiny.load_tokenizer()
    args = train_tiny.parse_args(["--kind", "v41", "--out", "x", "--phase2-from", "10",
                                  "--phase2-shares", "0,0,1", "--phase2-short-lookup-pairs", "5",
                                  "--phase2-short-lookup-share", "1", "--phase2-lookup-weight", "3"])
    assert train_tiny.data_mix(args, 9) == train_tiny.DataMix()          # the first phase's defaults
    defaults = train_tiny.parse_args(["--kind", "v41", "--out", "x"])
    assert train_tiny.data_mix(defaults, 449) == train_tiny.DataMix()
    assert train_tiny.data_mix(defaults, 450) == train_tiny.DataMix((0.30, 0.35, 0.35), 6, 0.8, 3.0)
    never = train_tiny.parse_args(["--kind", "v41", "--out", "x", "--phase2-from", "-1"])
    assert train_tiny.data_mix(never, 10**6) == train_tiny.DataMix()
    late = train_tiny.data_mix(args, 10)
    assert late == train_tiny.DataMix((0.0, 0.0, 1.0), 5, 1.0, 3.0, 4)
    kinds: list = []
    batch = train_tiny.training_batch(tok, random.Random(0), 4, 96, kinds, late)
    lookup = train_tiny.TRAIN_KINDS.index("lookup")
    for (ids, weights), kind in zip(batch, kinds):
        assert set(kind) == {-1, lookup}
        assert all((w == 3.0) == (k == lookup) for w, k in zip(weights, kind))
    text = tok.decode(batch[0][0][1:])
    assert all(line.count("=") <= 5 for line in text.split("\n")[:-1])   # short lookups only
    bad = train_tiny.parse_args(["--kind", "v41", "--out", "x", "--shares", "1,2"])
    with pytest.raises(SystemExit, match="three non-negative"):
        train_tiny.data_mix(bad, 0)
    # --short-lookup-least: training lookups below the language's four pairs (a curriculum)
    two = train_tiny.parse_args(["--kind", "v41", "--out", "x", "--phase2-from", "0", "--phase2-shares", "0,0,1",
                                 "--phase2-short-lookup-least", "2", "--phase2-short-lookup-pairs", "2",
                                 "--phase2-short-lookup-share", "1"])
    text = tok.decode(train_tiny.training_batch(tok, random.Random(0), 2, 96, None, train_tiny.data_mix(two, 0))[0][0][1:])
    assert all(line.count("=") == 2 for line in text.split("\n")[:-1])
    inverted = train_tiny.parse_args(["--kind", "v41", "--out", "x", "--short-lookup-least", "7",
                                      "--short-lookup-pairs", "6"])
    with pytest.raises(SystemExit, match="least <= most"):
        train_tiny.data_mix(inverted, 0)


def test_init_from_starts_from_the_checkpoint(tmp_path):
    """--init-from trains a written checkpoint further: at learning rate 0 its embedding and head
    (the compact rows the training starts from, the shared row of the other tokens included) come
    back byte for byte; another kind's checkpoint is refused."""
    first, second = tmp_path / "first", tmp_path / "second"
    common = ["--kind", "v41", "--batch", "2", "--seq-len", "48", "--draft-steps", "0"]
    assert train_tiny.main(common + ["--out", str(first), "--steps", "2"]) == 0
    assert train_tiny.main(common + ["--out", str(second), "--init-from", str(first), "--steps", "1",
                                     "--lr", "0"]) == 0
    a, b = _tensors(first), _tensors(second)
    for name in ("embed.weight", "head.weight"):
        assert torch.equal(a[name], b[name]), name
    with pytest.raises(SystemExit, match="training config"):
        train_tiny.main(["--kind", "v4", "--out", str(tmp_path / "x"), "--init-from", str(first)])
