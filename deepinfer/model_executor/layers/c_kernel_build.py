"""Build a small C kernel once per machine and load it with ctypes: the CPU's own kernels for the LM
head (layers/bf16_rows_gemm.py, layers/bf16_tiles_gemm.py), which torch has no op for.

The source is compiled with the system C compiler (envs.c_compiler: $CC, else cc) and -march=native,
so the binary is tied to this CPU's instruction set: the cache key is the source, the flags, the
compiler and the CPU's flags. The library lands in the user's cache (envs.user_cache_dir("kernels")),
written under a temporary name and renamed, so ranks that build at once each leave a whole file."""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
from pathlib import Path

from deepinfer import envs

logger = logging.getLogger(__name__)

# the head kernels' C signature: (h, w, out, M, V, D) -> 0, or an error code
GEMM_ARGTYPES = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]


def cpu_flags() -> set[str]:
    """The CPU's feature flags as /proc/cpuinfo lists them (empty where there is no such file)."""
    try:
        line = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), "")
    except OSError:
        line = ""
    return set(line.partition(":")[2].split())


def load_c_kernel(name: str, source: str, flags: list[str]) -> ctypes.CDLL:
    """The library built from `source` (building it if this machine has none cached). Raises OSError or
    subprocess.SubprocessError (with the compiler's stderr) where it cannot be built or loaded."""
    compiler = envs.c_compiler()
    cpu = f"{platform.machine()} {' '.join(sorted(cpu_flags()))}"
    key = hashlib.sha256("\n".join([source, " ".join(flags), compiler, cpu]).encode()).hexdigest()[:16]
    out = Path(envs.user_cache_dir("kernels")) / f"{name}_{key}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            src, lib = Path(tmp) / "k.c", Path(tmp) / "k.so"
            src.write_text(source)
            subprocess.run([compiler, *flags, str(src), "-o", str(lib)], check=True, capture_output=True, timeout=120)
            os.replace(lib, out)
    return ctypes.CDLL(str(out))


def load_gemm_kernel(name: str, source: str, flags: list[str]) -> ctypes.CDLL | None:
    """load_c_kernel with its entry point `name` bound to GEMM_ARGTYPES -> int; None, with the
    compiler's complaint logged, where it cannot be built or loaded."""
    try:
        lib = load_c_kernel(name, source, flags)
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", b"") or b""
        logger.warning("%s kernel unavailable (%s %s); its callers keep the fp32 GEMM", name, e,
                       detail.decode(errors="replace")[-500:])
        return None
    fn = getattr(lib, name)
    fn.restype, fn.argtypes = ctypes.c_int, GEMM_ARGTYPES
    return lib
