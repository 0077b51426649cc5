"""Every DEEPINFER_* environment variable: the only module that reads os.environ for them.

Each variable is one `EnvVar` row in `ENV_VARS`. Values are read at call time (`get(name)` or the
module attribute `envs.DEEPINFER_X`), never cached at import, so tests can monkeypatch os.environ.
Code that is traced (Neuron regions) must resolve what it needs before tracing, so Dynamo never
guards on the environment.

To add a variable: append an `EnvVar` row below, read it where it takes effect (tests/repo/test_env_reads.py
fails for a variable that nothing outside this module reads), then regenerate the README table with
`python -m deepinfer.envs` (tests/repo/test_envs_readme.py fails until the README matches).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclass(frozen=True)
class EnvVar:
    """One environment variable: `kind` is bool | int | str | choice | int_list."""

    name: str
    default: Any
    kind: str
    meaning: str
    choices: tuple[str, ...] = ()

    def parse(self, raw: str) -> Any:
        """Parse the raw string; ValueError names the variable and the allowed values."""
        text = raw.strip()
        if self.kind == "bool":
            if text.lower() in _TRUE:
                return True
            if text.lower() in _FALSE:
                return False
            raise ValueError(f"{self.name} must be one of 0/1/true/false (got {raw!r})")
        if self.kind == "int":
            try:
                value = int(text, 0)
            except ValueError:
                raise ValueError(f"{self.name} must be an integer (got {raw!r})") from None
            if value < 0:
                raise ValueError(f"{self.name} must be >= 0 (got {value})")
            return value
        if self.kind == "int_list":
            try:
                values = [int(x) for x in text.split(",") if x.strip()]
            except ValueError:
                raise ValueError(f"{self.name} must be comma-separated positive integers (got {raw!r})") from None
            if not values or any(v <= 0 for v in values):
                raise ValueError(f"{self.name} must be comma-separated positive integers (got {raw!r})")
            return sorted(set(values))
        if self.kind == "choice":
            value = text.lower() if all(c == c.lower() for c in self.choices) else text.upper()
            if value not in self.choices:
                raise ValueError(f"{self.name} must be one of {'|'.join(self.choices)} (got {raw!r})")
            return value
        if self.kind == "str":
            return text
        raise AssertionError(f"unknown kind {self.kind!r} for {self.name}")

    @property
    def type_text(self) -> str:
        """The type column of the README table."""
        if self.kind == "choice":
            return " \\| ".join(self.choices)
        return {"bool": "bool (0/1)", "int": "int", "str": "str", "int_list": "int list (comma-separated)"}[self.kind]

    @property
    def default_text(self) -> str:
        """The default column of the README table."""
        if self.default is None:
            return "unset"
        if self.kind == "bool":
            return "1" if self.default else "0"
        if isinstance(self.default, list):
            return ",".join(str(v) for v in self.default)
        return str(self.default)


ENV_VARS: list[EnvVar] = [
    EnvVar("DEEPINFER_ACCELERATOR", None, "choice",
           "Platform to run on; wins over detection. Unset: /dev/neuron* -> neuron, CUDA -> cuda, else cpu.",
           ("cpu", "cuda", "neuron")),
    EnvVar("DEEPINFER_CPU_COMPILE", False, "bool",
           "cpu platform: run decode and verification steps through compiled decoder-layer regions "
           "(static row buckets, worker/runners/cpu_compiled.py); 0 runs every step eagerly, as "
           "enforce_eager does. Read when the worker picks its runner."),
    EnvVar("DEEPINFER_CPU_COMPILE_BACKEND", "inductor", "choice",
           "torch.compile backend of the cpu platform's compiled regions (DEEPINFER_CPU_COMPILE=1): inductor "
           "generates fused CPU code; aot_eager traces the same graphs without code generation (fast to "
           "compile, eager speed).",
           ("inductor", "aot_eager")),
    EnvVar("DEEPINFER_CPU_COMPILE_WRAPPER", "cpp", "choice",
           "cpu platform, inductor regions (DEEPINFER_CPU_COMPILE=1): cpp compiles the code that calls a "
           "graph's kernels (allocations, views, shape checks, the GEMM calls) into C++ with the kernels "
           "(inductor's cpp_wrapper; about 1 ms a step less at batch 1, a longer first compile); python "
           "runs it as inductor's generated Python.",
           ("cpp", "python")),
    EnvVar("DEEPINFER_CPU_COMPILE_SCOPE", "step", "choice",
           "cpu platform, compiled steps (DEEPINFER_CPU_COMPILE=1): step compiles each bucket's whole step "
           "(entry, every decoder layer, exit) as one graph; layer compiles Neuron's regions, one a decoder "
           "layer kind plus the entry and exit (more graph calls a step, each paying Dynamo's entry and "
           "inductor's wrapper; neuron_ops/regions.py COMPILE_SCOPES).",
           ("step", "layer")),
    EnvVar("DEEPINFER_CPU_PREFILL_BUCKETS", None, "int_list",
           "cpu platform, compiled steps (DEEPINFER_CPU_COMPILE=1): prompt-chunk buckets (tokens), e.g. 64,256; "
           "a prompt step of at most the largest runs compiled, padded to the smallest that holds it (one graph "
           "per bucket x context bucket, compiled on first use). Unset: prompt steps run eagerly with the "
           "fused prompt kernels."),
    EnvVar("DEEPINFER_CPU_KEEP_FREED_MEMORY", True, "bool",
           "cpu platform: when a rank starts, raise glibc's mmap / trim thresholds (256 / 512 MiB, process-"
           "wide) so each step's buffers reuse freed heap pages instead of faulting in fresh ones "
           "(platforms/host_allocator.py); 0 leaves the C library's defaults."),
    EnvVar("DEEPINFER_CPU_SKIP_WARM_GUARDS", True, "bool",
           "cpu platform, compiled steps (DEEPINFER_CPU_COMPILE=1): once a step's bucket and layout have run "
           "twice with every Dynamo guard evaluated and nothing compiled, its region calls evaluate only the "
           "guards that tell graphs apart (torch's skip_guard_eval_unsafe stance; worker/runners/"
           "warm_guards.py says why that is safe here); 0 evaluates every guard on every call."),
    EnvVar("DEEPINFER_CPU_BF16_HEAD", True, "bool",
           "cpu platform, fp32 models, ranks of one thread: an LM head whose values are all bf16 (a bf16 "
           "checkpoint head) also keeps a bf16 copy, which a C kernel multiplies in fp32 from half the bytes "
           "(DEEPINFER_CPU_BF16_HEAD_KERNEL says which); 0 keeps the fp32 GEMM only."),
    EnvVar("DEEPINFER_CPU_BF16_HEAD_KERNEL", "auto", "choice",
           "Which kernel multiplies the bf16 head copy: tiles (layers/bf16_tiles_gemm.py, the CPU's AMX "
           "unit, every row count), rows (layers/bf16_rows_gemm.py, vector FMAs, steps of at most 16 rows), "
           "or auto: tiles where the CPU has AMX and the head's shape suits it, else rows.",
           ("auto", "tiles", "rows")),
    EnvVar("DEEPINFER_NEURON_HOST", False, "bool",
           "Run the Neuron platform in host mode (on CPU) even where a Neuron device exists. Without a "
           "device, neuron is always host mode."),
    EnvVar("DEEPINFER_NEURON_ROW_BUCKETS", None, "int_list",
           "Decode row buckets of the Neuron graphs, powers of two, e.g. 1,2,4,8,16,32,64; the largest "
           "must be >= max_num_seqs. Unset: 8 and the next power of two >= max_num_seqs."),
    EnvVar("DEEPINFER_NEURON_CTX_BUCKETS", None, "int_list",
           "Context-length buckets of the Neuron graphs, e.g. 1024,4096,16384; the largest must be >= "
           "max_model_len. Unset: max_model_len alone."),
    EnvVar("DEEPINFER_NEURON_PREFILL_BUCKET", None, "int_list",
           "Prompt-chunk buckets (tokens) compiled for Neuron, e.g. 128,512, each at most "
           "max_num_batched_tokens; a prompt step runs in the smallest that holds it (one graph per "
           "bucket x context bucket x layer kind); each is rounded up to a power of two. Unset: "
           "max_num_batched_tokens."),
    EnvVar("DEEPINFER_NEURON_REGION_SPLIT", "prompt", "choice",
           "How Neuron region graphs cut a decoder layer: prompt runs prompt-chunk steps as three "
           "sub-regions (projections, indexer and attention, MoE) and decode and verification steps as one "
           "region a layer (a verification step shares the graphs of the decode bucket of its token count); "
           "multi_row splits verification steps too; never: one region a layer always; always: "
           "sub-regions for every step.",
           ("prompt", "multi_row", "never", "always")),
    EnvVar("DEEPINFER_NEURON_VERIFY_ROWS", None, "int_list",
           "Row buckets that get a speculative verification bucket (rows x (1 + B) tokens, padded to a power "
           "of two), each one of the row buckets. Unset: those whose verification bucket holds at most as "
           "many tokens as the largest row bucket; verification steps with more rows run in the "
           "prompt-chunk bucket."),
    EnvVar("DEEPINFER_NEURON_COMPILE_CACHE_DIR", None, "str",
           "Persistent compile cache of the Neuron graphs when the engine's compile_cache_dir is not "
           "given. Unset: ~/.cache/deepinfer/neuron-compile ($XDG_CACHE_HOME/deepinfer/neuron-compile). "
           "Device mode hands it to torch-neuronx (TORCH_NEURONX_NEFF_CACHE_DIR, NEURON_COMPILE_CACHE_URL, "
           "unless already set); host mode only records it."),
    EnvVar("DEEPINFER_NEURON_FP8_GUARD", False, "bool",
           "Log every unsafe float8 op (cat, stack, advanced index, gather, scatter, where) with its call "
           "site: eager code through a TorchFunctionMode, compiled regions by scanning their graphs, which "
           "also report any float8 value (none may appear: fp8 bytes cross a graph as uint8)."),
    EnvVar("DEEPINFER_NEURON_COMPILE_BACKEND", "aot_eager", "choice",
           "torch.compile backend for Neuron regions in host mode (device mode always uses neuron).",
           ("aot_eager", "inductor")),
    EnvVar("DEEPINFER_NEURON_KERNELS", "reference", "choice",
           "Neuron host mode: reference runs every kernel as its PyTorch reference; simulate runs each "
           "kernel that has an NKI implementation in the NumPy NKI interpreter inside the engine "
           "(slow; counts in deepinfer.neuron_ops.nki.simulation_counts()). Read when the platform is made.",
           ("reference", "simulate")),
    EnvVar("DEEPINFER_LOG_LEVEL", "INFO", "choice",
           "Level of the deepinfer loggers (the server's included), applied when deepinfer is first "
           "imported; deepinfer.logging_config.configure_logging(level) overrides it. INFO: the startup "
           "lines (config, weights, KV pool, graphs); DEBUG adds one line per engine step. Records go to "
           "the application's logging handlers, or to stderr when the root logger has none.",
           ("DEBUG", "INFO", "WARNING", "ERROR")),
    EnvVar("DEEPINFER_KV_CACHE_MEMORY_BYTES", 1 << 30, "int",
           "Memory budget (bytes) for the KV block pool when num_kv_blocks is not given."),
    EnvVar("DEEPINFER_RANK_STEP_TIMEOUT", 600, "int",
           "Default of the rank_step_timeout engine option: seconds a step of a model on several ranks may "
           "wait for a follower before that follower is named hung, killed and the engine fails (0: wait "
           "forever). Well above the slowest step, a first graph compile included."),
    EnvVar("DEEPINFER_ENGRAM_STOP_AT_BOS", False, "bool",
           "Engram n-gram lookbacks stop at segment boundaries: no n-gram reaches back past a BOS at or "
           "before its token, or past an EOS before it (those slots hash as the pad id). Read when the "
           "model builds its Engram hash spec. Off: lookbacks run back to the sequence start."),
]

_BY_NAME = {v.name: v for v in ENV_VARS}
assert len(_BY_NAME) == len(ENV_VARS), "duplicate DEEPINFER_* entry"
assert all("|" not in v.meaning for v in ENV_VARS), "a meaning may not contain '|' (README table cell)"


def spec(name: str) -> EnvVar:
    """The registry row of `name`; KeyError for an unregistered variable."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"{name} is not a registered DEEPINFER_* variable (add it to deepinfer/envs.py)") from None


def get(name: str) -> Any:
    """The parsed value of `name` now (os.environ read at call time), or its default."""
    row = spec(name)
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return row.default
    return row.parse(raw)


def user_cache_dir(*parts: str) -> str:
    """deepinfer's directory under the user's cache ($XDG_CACHE_HOME, else ~/.cache), joined with parts:
    where the Neuron compile cache and the CPU kernels built at first use live."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "deepinfer", *parts)


def c_compiler() -> str:
    """The C compiler that builds deepinfer's CPU kernels: $CC, else cc."""
    return os.environ.get("CC") or "cc"


def __getattr__(attr: str) -> Any:
    # `envs.DEEPINFER_X` reads lazily, like get().
    if attr in _BY_NAME:
        return get(attr)
    raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")


def markdown_table() -> str:
    """The README table of every variable, one row per registry entry."""
    lines = ["| Variable | Default | Type | Meaning |", "|---|---|---|---|"]
    for row in ENV_VARS:
        lines.append(f"| `{row.name}` | {row.default_text} | {row.type_text} | {row.meaning} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.stdout.write(markdown_table() + "\n")
