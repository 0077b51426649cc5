"""The compact form of a trained tiny checkpoint (examples/train_tiny.py), small enough to commit,
and its expansion back to the full checkpoint in the real layout.

    python examples/tools/trained_artifact.py expand ARTIFACT.safetensors OUT_DIR

A trained checkpoint's vocabulary-sized tensors (embedding, LM head, the DSpark Markov head, V4's
hash-routing table) are 129,280 rows of which the language uses about 2,000; every other row is
either one shared trained row (embedding, head: the training softmax gave all other tokens one row)
or its seeded initial value (tensors whose other rows were never trained). The artifact stores the
other tensors exactly as the checkpoint stores them (fp8 / fp4 codes and ue8m0 scales, fp32, bf16),
the language's rows of the vocabulary tensors, and per vocabulary tensor which of the two fills
the other rows; `expand` rebuilds every stored tensor bit for bit.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(_HERE)))  # deepinfer, from a checkout

import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

SHARED_ROW = "shared_row"   # every other row equals one stored row
SEEDED = "seeded"           # every other row is the tensor's seeded initial value


def _load_dir(ckpt: str | os.PathLike) -> dict[str, torch.Tensor]:
    tensors = {}
    for f in sorted(Path(ckpt).glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            tensors.update({k: fh.get_tensor(k) for k in fh.keys()})
    return tensors


def _seeded_stored(cfg, name: str, seed: int) -> dict[str, torch.Tensor]:
    """The stored tensors (weight and scale) of `name`'s seeded initial value."""
    from deepinfer.model_executor.checkpoint_schema import tensor_format, tensor_shapes
    from deepinfer.model_executor.tiny_checkpoint import dense_value, stored_tensors
    quantized = cfg.quant is not None
    block = tuple(cfg.quant["weight_block_size"]) if quantized else (128, 128)
    value = dense_value(cfg, name, tensor_shapes(cfg)[name], seed)
    return stored_tensors(cfg, name, value, tensor_format(cfg, name, quantized), torch.float32, block)


def vocab_tensors(cfg, tensors: dict[str, torch.Tensor]) -> list[str]:
    """The stored tensors with one row per vocabulary id."""
    return [k for k, t in tensors.items() if t.dim() >= 1 and t.shape[0] == cfg.vocab_size]


def pack_artifact(ckpt: str | os.PathLike, path: str | os.PathLike, used: list[int], seed: int) -> int:
    """Write the artifact of checkpoint `ckpt` (trained with `seed`, language token ids `used`);
    returns its size in bytes. Raises if a vocabulary tensor's other rows follow neither fill."""
    from deepinfer.config import ModelConfig
    raw = json.loads((Path(ckpt) / "config.json").read_text())
    cfg = ModelConfig.from_dict(raw)
    tensors = _load_dir(ckpt)
    ids = torch.tensor(sorted(used))
    other = torch.ones(cfg.vocab_size, dtype=torch.bool)
    other[ids] = False
    out, fills = {}, {}
    for name in vocab_tensors(cfg, tensors):
        t = tensors[name]
        rest = t[other]
        if bool((rest == rest[:1]).all()):
            fills[name] = SHARED_ROW
            out[name] = torch.cat([t[ids], rest[:1]])
        else:
            owner = name[: -len(".scale")] + ".weight" if name.endswith(".scale") else name
            seeded = _seeded_stored(cfg, owner, seed)[name]
            if not torch.equal(rest, seeded[other]):
                raise ValueError(f"{name}: the rows outside the language are neither one shared row nor the "
                                 f"seed {seed} initial values")
            fills[name] = SEEDED
            out[name] = t[ids]
    for name, t in tensors.items():
        if name not in fills:
            out[name] = t
    meta = {"config": json.dumps(raw), "used": json.dumps(ids.tolist()), "fills": json.dumps(fills),
            "seed": str(seed), "format": "pt"}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in out.items()}, str(path), metadata=meta)
    return os.path.getsize(path)


def expand_artifact(path: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Write the full checkpoint (model.safetensors, config, tokenizer) of artifact `path`."""
    from deepinfer.config import ModelConfig
    from deepinfer.model_executor.tiny_checkpoint import write_side_files
    with safe_open(str(path), "pt") as fh:
        meta = fh.metadata()
        stored = {k: fh.get_tensor(k) for k in fh.keys()}
    raw = json.loads(meta["config"])
    cfg = ModelConfig.from_dict(raw)
    ids = torch.tensor(json.loads(meta["used"]))
    fills, seed = json.loads(meta["fills"]), int(meta["seed"])
    tensors = {}
    for name, t in stored.items():
        fill = fills.get(name)
        if fill is None:
            tensors[name] = t
            continue
        if fill == SHARED_ROW:
            full = t[-1:].expand(cfg.vocab_size, *t.shape[1:]).clone()
            full[ids] = t[:-1]
        elif fill == SEEDED:
            owner = name[: -len(".scale")] + ".weight" if name.endswith(".scale") else name
            full = _seeded_stored(cfg, owner, seed)[name].clone()
            full[ids] = t
        else:
            raise ValueError(f"{path}: {name} has an unknown fill {fill!r}")
        tensors[name] = full
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob("model*.safetensors"), out / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    write_side_files(raw, out)
    return out


def main(argv=None) -> int:
    import argparse
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("expand", help="artifact -> full checkpoint directory")
    e.add_argument("artifact")
    e.add_argument("out")
    args = ap.parse_args(argv)
    expand_artifact(args.artifact, args.out)
    print(f"expanded {args.artifact} -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
