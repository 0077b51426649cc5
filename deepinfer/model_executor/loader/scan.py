"""What a checkpoint directory holds: its safetensors files (one file, shards named by
`model.safetensors.index.json`, or a folder of shards) and each stored tensor's key, file, dtype and
shape, read from the file headers only; and the fp8 block size its config.json declares."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

INDEX_FILE = "model.safetensors.index.json"

ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E8M0": torch.float8_e8m0fnu, "I8": torch.int8, "U8": torch.uint8,
    "I16": torch.int16, "I32": torch.int32, "I64": torch.int64, "BOOL": torch.bool,
}

# DSpark head tensors that DI reads from one mtp index only; copies at other indices are ignored


@dataclass
class Stored:
    key: str  # name in the file
    file: str
    dtype: torch.dtype
    shape: tuple

    def describe(self) -> str:
        return f"shape {self.shape} dtype {dtype_name(self.dtype)} ({self.key!r} in {self.file})"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def open_safetensors(path: Path):
    """safe_open, with a damaged file named: a truncated download or copy fails the header check
    (the data offsets must cover the file), which safetensors reports without the file's name."""
    try:
        return safe_open(str(path), framework="pt")
    except SafetensorError as e:
        raise ValueError(f"{path}: the safetensors file is incomplete or corrupt ({e}); copy or download it "
                         f"again") from None


def scan(model_dir: Path) -> dict[str, Stored]:
    index_path = model_dir / INDEX_FILE
    if index_path.is_file():
        weight_map = json.loads(index_path.read_text()).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index_path}: 'weight_map' must be a non-empty object")
        files = sorted(set(weight_map.values()))
    elif (model_dir / "model.safetensors").is_file():
        weight_map, files = None, ["model.safetensors"]
    else:
        files = sorted(p.name for p in model_dir.glob("*.safetensors"))
        weight_map = None
        if not files:
            raise ValueError(f"no safetensors files (or {INDEX_FILE}) in {model_dir}")
    stored: dict[str, Stored] = {}
    for fname in files:
        path = model_dir / fname
        if not path.is_file():
            raise ValueError(f"{INDEX_FILE} lists shard {fname!r}, which does not exist in {model_dir}")
        with open_safetensors(path) as f:
            for key in f.keys():
                if weight_map is not None and weight_map.get(key) != fname:
                    continue  # the index decides which shard holds a tensor
                if key in stored:
                    raise ValueError(f"tensor {key!r} is stored twice ({stored[key].file} and {fname})")
                sl = f.get_slice(key)
                st_dtype = sl.get_dtype()
                if st_dtype not in ST_DTYPES:
                    raise ValueError(f"tensor {key!r} in {fname}: unsupported dtype {st_dtype}")
                stored[key] = Stored(key, fname, ST_DTYPES[st_dtype], tuple(sl.get_shape()))
    if weight_map is not None:
        for key, fname in weight_map.items():
            if key not in stored:
                raise ValueError(f"{INDEX_FILE} lists tensor {key!r} in {fname!r}, but that file does not hold it")
    return stored


def block_hint(model_dir: Path) -> tuple[int, int] | None:
    path = model_dir / "config.json"
    if not path.is_file():
        return None
    try:
        q = json.loads(path.read_text()).get("quantization_config") or {}
        block = q.get("weight_block_size")
        return (int(block[0]), int(block[1])) if block else None
    except (ValueError, TypeError, IndexError, AttributeError):
        return None
