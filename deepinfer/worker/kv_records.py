"""Record formats of the cache stores (docs/model.md §5.1).

`plain` stores values in the compute dtype. `compact` stores DeepSeek's records as bytes:
- SWA kv: e4m3 values + one ue8m0 scale per 32 (528 B for d = 512);
- compressed main KV: packed e2m1 + one e4m3 scale per 16 (288 B for d = 512);
- index keys: packed e2m1 + one ue8m0 scale per 32 (68 B for 128 values).
Writes encode, reads decode only the gathered rows, so attention always sees dequantized values
(and, as in DeepSeek's prefill, this step's own SWA rows are read back round-tripped).
Every e4m3 byte written (SWA values, main-KV scales) is at most the platform's `fp8_max` in
magnitude: 448 for OCP e4m3fn, 224 on Neuron, whose device reads the bytes as IEEE e4m3 (max 240).
The byte codecs are custom ops (worker/kv_codecs.py): a compiled region sees uint8 records and
values, never a float8 tensor (docs/neuron.md §4 A9); on a device without a kernel for them the
same math is traced with integer e4m3 arithmetic instead."""
import torch

from deepinfer.model_executor.layers import quant
from deepinfer.worker import kv_codecs


class PlainFormat:
    name = "plain"

    def __init__(self, width: int, dtype: torch.dtype):
        self.width, self.dtype = width, dtype

    def record_bytes(self) -> int:
        return self.width * torch.finfo(self.dtype).bits // 8

    def alloc(self, rows: int, device) -> torch.Tensor:
        return torch.zeros(rows, self.width, dtype=self.dtype, device=device)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.dtype)

    def decode(self, rec: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return rec.to(dtype)


class Fp8Ue8m0Format:
    """e4m3 bytes followed by one ue8m0 byte per 32 values."""
    name = "fp8_ue8m0"

    def __init__(self, width: int, fp8_max: float = quant.FP8_E4M3_MAX):
        assert width % 32 == 0
        self.width, self.fp8_max = width, fp8_max

    def record_bytes(self) -> int:
        return kv_codecs.fp8_record_bytes(self.width)

    def alloc(self, rows: int, device) -> torch.Tensor:
        rec = torch.zeros(rows, self.record_bytes(), dtype=torch.uint8, device=device)
        rec[:, self.width:] = 127  # scale 2^0, so never-written rows decode to zeros
        return rec

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        if kv_codecs.traced_on(x):
            return kv_codecs.fp8_encode(x, self.fp8_max, int_codes=True)
        return kv_codecs.fp8_record_encode(x, self.fp8_max)

    def decode(self, rec: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if kv_codecs.traced_on(rec):
            return kv_codecs.fp8_decode(rec, self.width, dtype, int_codes=True)
        return kv_codecs.fp8_record_decode(rec, self.width, dtype)


class Fp4Format:
    """Packed e2m1 bytes followed by one scale byte per `group` values (e4m3 or ue8m0)."""

    def __init__(self, width: int, group: int, scale_fmt: str, fp8_max: float = quant.FP8_E4M3_MAX):
        assert width % group == 0 and group % 2 == 0
        self.width, self.group, self.scale_fmt, self.fp8_max = width, group, scale_fmt, fp8_max
        self.name = f"fp4_{scale_fmt}_{group}"

    def record_bytes(self) -> int:
        return kv_codecs.fp4_record_bytes(self.width, self.group)

    def alloc(self, rows: int, device) -> torch.Tensor:
        rec = torch.zeros(rows, self.record_bytes(), dtype=torch.uint8, device=device)
        if self.scale_fmt == "ue8m0":
            rec[:, self.width // 2:] = 127
        return rec

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        if kv_codecs.traced_on(x):
            return kv_codecs.fp4_encode(x, self.group, self.scale_fmt, self.fp8_max, int_codes=True)
        return kv_codecs.fp4_record_encode(x, self.group, self.scale_fmt, self.fp8_max)

    def decode(self, rec: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if kv_codecs.traced_on(rec):
            return kv_codecs.fp4_decode(rec, self.width, self.group, self.scale_fmt, dtype, int_codes=True)
        return kv_codecs.fp4_record_decode(rec, self.width, self.group, self.scale_fmt, dtype)


def record_format(kind: str, width: int, mode: str, dtype: torch.dtype, fp8_max: float = quant.FP8_E4M3_MAX):
    """Format of one store kind ("swa" | "entries" | "index") in a cache mode ("plain" | "compact");
    fp8_max: the platform's largest e4m3 magnitude to encode."""
    if mode == "plain":
        return PlainFormat(width, dtype)
    if mode != "compact":
        raise ValueError(f"kv_cache_mode: expected 'plain' or 'compact', got {mode!r}")
    if kind == "swa":
        return Fp8Ue8m0Format(width, fp8_max)
    if kind == "entries":
        return Fp4Format(width, 16, "e4m3", fp8_max)
    if kind == "index":
        return Fp4Format(width, 32, "ue8m0")
    raise ValueError(f"kind: no compact format for {kind!r}")
