"""EngineConfig: the engine's typed, validated knobs (vLLM names), and their one description.

Model-dependent defaults (max_model_len) are resolved once the ModelConfig is known, through
`resolve(model_config)`; the worker fills in `block_size` / `num_kv_blocks` when they are None.

Every field carries its help text (and choices) as dataclass metadata. `LLM(model, **options)` and
the server's command line are both built from these fields (`add_engine_args`,
`engine_config_from_args`), so a new field is an option of both, under one name and one default.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field

_DTYPES = ("auto", "bfloat16", "float32")
_KV_CACHE_MODES = ("plain", "compact")
_WEIGHT_FORMATS = ("auto", "packed", "dense")
_SPEC_VERIFY = ("all", "confidence")
_DEFAULT_MAX_MODEL_LEN = 4096
_FALLBACK_KV_CACHE_BYTES = 1 << 30


def _default_kv_cache_memory_bytes() -> int:
    # Env vars are read only in deepinfer/envs.py (DEEPINFER_KV_CACHE_MEMORY_BYTES).
    try:
        from deepinfer import envs
        return int(envs.DEEPINFER_KV_CACHE_MEMORY_BYTES)
    except (ImportError, AttributeError):
        return _FALLBACK_KV_CACHE_BYTES


def _default_rank_step_timeout() -> int:
    from deepinfer import envs
    return int(envs.DEEPINFER_RANK_STEP_TIMEOUT)


def _check_int(name: str, value, low: int, high: int | None = None, allow_none: bool = False):
    if value is None and allow_none:
        return
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= low
    if ok and high is not None:
        ok = value <= high
    if not ok:
        allowed = f"an integer >= {low}" if high is None else f"an integer in [{low}, {high}]"
        if allow_none:
            allowed += " or None"
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


def _option(default=dataclasses.MISSING, *, help: str, default_factory=dataclasses.MISSING,
            choices: tuple[str, ...] | None = None, value_type: type | None = None,
            default_text: str | None = None):
    """A field that is also an engine option: `help` (and `choices`) feed the command line.

    value_type: the parsed type of a command-line value for a field whose default is None or
    computed (otherwise the default's type). default_text: what --help says the default is, for a
    default that is not a plain value.
    """
    metadata = {"help": help, "choices": choices, "value_type": value_type,
                "default_text": default_text}
    if default_factory is not dataclasses.MISSING:
        return field(default_factory=default_factory, metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class EngineConfig:
    model: str = _option(help="checkpoint directory", value_type=str)
    tokenizer: str | None = _option(None, help="tokenizer path", value_type=str,
                                    default_text="the model path")
    dtype: str = _option("auto", help="compute dtype ('auto': the checkpoint's)", choices=_DTYPES)
    max_model_len: int | None = _option(
        None, help="longest sequence (prompt + output) in tokens", value_type=int,
        default_text=f"min(max_position_embeddings, {_DEFAULT_MAX_MODEL_LEN})")
    max_num_seqs: int = _option(64, help="sequences running at once")
    max_num_batched_tokens: int = _option(
        2048, help="tokens in one step (prompt chunks + decodes); at least max_num_seqs")
    num_kv_blocks: int | None = _option(
        None, help="KV blocks in the pool", value_type=int,
        default_text="sized by the worker from kv_cache_memory_bytes")
    block_size: int | None = _option(None, help="token positions per KV block", value_type=int,
                                     default_text="the worker's choice")
    enforce_eager: bool = _option(False, help="no CUDA / Neuron graphs: every step runs eagerly")
    enable_prefix_caching: bool = _option(
        True, help="reuse the KV blocks (and their boundary state) of prompt prefixes computed before: "
                   "full blocks are hashed by their tokens and shared, evicted least-recently-used only "
                   "when the pool runs out (docs/prefix_caching.md; eager runners only)")
    # Compiling every graph up front means no request waits for a compile.
    warmup_graphs: bool = _option(
        False, help="compile (Neuron) or capture (CUDA) every bucket's graph when the engine starts "
                    "instead of on a bucket's first step")
    compile_cache_dir: str | None = _option(
        None, value_type=str,
        default_text="$DEEPINFER_NEURON_COMPILE_CACHE_DIR, else ~/.cache/deepinfer/neuron-compile",
        help="Neuron: directory of the compiler's persistent cache, so graphs compiled once are reused "
             "by later runs and by every rank of the host")
    seed: int = _option(0, help="engine seed (sampling of unseeded requests)")
    skip_tokenizer_init: bool = _option(
        False, help="load no tokenizer: prompts must be token ids and outputs carry no text")
    # Computed at construction, so DEEPINFER_KV_CACHE_MEMORY_BYTES is read when the config is built.
    kv_cache_memory_bytes: int = _option(
        help="memory budget (bytes) of the KV block pool when num_kv_blocks is not given",
        default_factory=_default_kv_cache_memory_bytes, value_type=int,
        default_text=f"$DEEPINFER_KV_CACHE_MEMORY_BYTES, else {_FALLBACK_KV_CACHE_BYTES}")
    kv_cache_mode: str = _option(
        "plain", choices=_KV_CACHE_MODES,
        help="'plain': cache values in the compute dtype; 'compact': DeepSeek's records (fp8 e4m3 "
             "SWA with ue8m0 scales, fp4 compressed entries and index keys), dequantized when read")
    weight_format: str = _option(
        "auto", choices=_WEIGHT_FORMATS,
        help="'packed': quantized weights stay as the checkpoint stores them (fp8 e4m3 / fp4 e2m1 "
             "codes with ue8m0 scales) and are dequantized tile by tile inside the GEMM kernels; "
             "'dense': dequantized once at load; 'auto': the platform's default (packed on neuron and "
             "cuda, dense on cpu)")
    # One model across ranks (docs/architecture.md §8): world = max(cp, ep) processes, one per device.
    context_parallel_size: int = _option(
        1, help="ranks of one CP group: they run the same rows (the driver schedules and samples, the "
                "others follow); attention heads are sharded over lanes of attention_tp_size of them")
    expert_parallel_size: int = _option(
        1, help="ranks the routed experts are sharded over; when larger than context_parallel_size, the "
                "world has ep / cp CP groups, each running its own share of the step's rows "
                "(data-parallel attention)")
    attention_tp_size: int | None = _option(
        None, value_type=int, default_text="min(context_parallel_size, 8)",
        help="ranks a lane shards the attention heads over (consecutive ranks of a CP group)")
    nnodes: int = _option(1, help="hosts the world spans; each runs world / nnodes consecutive ranks")
    node_rank: int = _option(
        0, help="this host's index; 0 runs the engine (the driver), the others run `deepinfer follow`")
    master_addr: str = _option("127.0.0.1", help="address of node 0 (the torch.distributed store)")
    master_port: int | None = _option(
        None, value_type=int, default_text="a free port on a single node; required with nnodes > 1",
        help="TCP port of the torch.distributed store on master_addr")
    # A hung follower leaves the driver in a collective: past this the watchdog kills it (executor/local_ranks.py).
    rank_step_timeout: int = _option(
        help="seconds a step may wait for a follower rank before that rank is named hung, killed and the "
             "engine fails (0: wait forever); well above the slowest step, a first graph compile included",
        default_factory=_default_rank_step_timeout, value_type=int,
        default_text="$DEEPINFER_RANK_STEP_TIMEOUT, else 600")
    num_speculative_tokens: int = _option(
        0, help="DSpark drafts verified per sequence and decode step (speculative decoding with the "
                "checkpoint's draft layers; deepseek_v41 checkpoints with num_nextn_predict_layers > 0 "
                "only); 0 = off")
    speculative_draft_vocab: str | None = _option(
        None, value_type=str,
        help="a JSON file whose \"token_ids\" are the only tokens drafts may take (a frequency-ranked draft "
             "vocabulary: examples/tools/build_draft_vocab.py); the draft heads then read only those rows "
             "of the LM and Markov heads. Verification keeps the whole vocabulary, so greedy tokens do not "
             "change and sampled ones stay distributed as the target; None: drafts over the whole vocabulary")
    speculative_verify: str = _option(
        "all", choices=_SPEC_VERIFY,
        help="which drafts a decode row verifies: 'all' of them (a seeded sampled request's tokens do not "
             "depend on the batch); 'confidence': per step, the drafts with the highest predicted "
             "acceptance, as many as maximise expected tokens per measured step time (greedy tokens are "
             "unchanged, sampled ones stay distributed as the target; spec/verify_plan.py)")

    def __post_init__(self):
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a non-empty path string, got {self.model!r}")
        if self.tokenizer is None:
            self.tokenizer = self.model
        if not isinstance(self.tokenizer, str) or not self.tokenizer:
            raise ValueError(f"tokenizer must be a non-empty path string or None, got {self.tokenizer!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        _check_int("max_model_len", self.max_model_len, 2, allow_none=True)
        _check_int("max_num_seqs", self.max_num_seqs, 1)
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        # Every running sequence decodes each step, so one step must hold a token for each of them.
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens must be >= max_num_seqs ({self.max_num_seqs}), "
                f"got {self.max_num_batched_tokens}")
        # Block 0 is the reserved scratch block, so a usable pool has at least two.
        _check_int("num_kv_blocks", self.num_kv_blocks, 2, allow_none=True)
        _check_int("block_size", self.block_size, 1, allow_none=True)
        for name in ("enforce_eager", "warmup_graphs", "skip_tokenizer_init"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.compile_cache_dir is not None and (not isinstance(self.compile_cache_dir, str)
                                                   or not self.compile_cache_dir):
            raise ValueError(f"compile_cache_dir must be a non-empty path string or None, got "
                             f"{self.compile_cache_dir!r}")
        _check_int("seed", self.seed, 0, (1 << 63) - 1)
        _check_int("kv_cache_memory_bytes", self.kv_cache_memory_bytes, 1)
        if self.kv_cache_mode not in _KV_CACHE_MODES:
            raise ValueError(f"kv_cache_mode must be one of {_KV_CACHE_MODES}, got {self.kv_cache_mode!r}")
        _check_int("num_speculative_tokens", self.num_speculative_tokens, 0, 16)
        if self.num_speculative_tokens:
            # A decode row verifies all of its drafts in one step.
            if self.max_num_batched_tokens < 1 + self.num_speculative_tokens:
                raise ValueError(f"max_num_batched_tokens must be >= 1 + num_speculative_tokens "
                                 f"({1 + self.num_speculative_tokens}), got {self.max_num_batched_tokens}")
        if self.speculative_draft_vocab is not None:
            if not isinstance(self.speculative_draft_vocab, str) or not self.speculative_draft_vocab:
                raise ValueError(f"speculative_draft_vocab must be a non-empty path string or None, got "
                                 f"{self.speculative_draft_vocab!r}")
            if not self.num_speculative_tokens:
                raise ValueError("speculative_draft_vocab needs num_speculative_tokens > 0")
        if self.speculative_verify not in _SPEC_VERIFY:
            raise ValueError(f"speculative_verify must be one of {_SPEC_VERIFY}, got {self.speculative_verify!r}")
        if self.weight_format not in _WEIGHT_FORMATS:
            raise ValueError(f"weight_format must be one of {_WEIGHT_FORMATS}, got {self.weight_format!r}")
        self._check_parallel()

    def _check_parallel(self) -> None:
        _check_int("context_parallel_size", self.context_parallel_size, 1)
        _check_int("expert_parallel_size", self.expert_parallel_size, 1)
        _check_int("attention_tp_size", self.attention_tp_size, 1, allow_none=True)
        _check_int("nnodes", self.nnodes, 1)
        _check_int("node_rank", self.node_rank, 0)
        _check_int("master_port", self.master_port, 1, 65535, allow_none=True)
        _check_int("rank_step_timeout", self.rank_step_timeout, 0)
        if not isinstance(self.master_addr, str) or not self.master_addr:
            raise ValueError(f"master_addr must be a non-empty host name or address, got {self.master_addr!r}")
        if self.node_rank >= self.nnodes:
            raise ValueError(f"node_rank must be in [0, nnodes - 1] (nnodes={self.nnodes}), got {self.node_rank}")
        if self.nnodes > 1 and self.master_port is None:
            raise ValueError("master_port is required when nnodes > 1: every host must name the same port "
                             "of node 0's store")
        self.parallel_layout()   # ParallelLayout checks the sizes against each other

    @property
    def lane_size(self) -> int:
        """attention_tp_size, resolved (default: min(context_parallel_size, 8), docs/neuron.md §5.6)."""
        if self.attention_tp_size is not None:
            return self.attention_tp_size
        return min(self.context_parallel_size, 8)

    @property
    def world_size(self) -> int:
        return max(self.context_parallel_size, self.expert_parallel_size)

    def parallel_layout(self, rank: int = 0):
        """The ParallelLayout of global rank `rank` (ValueError for sizes that do not fit together)."""
        from deepinfer.distributed.parallel_layout import ParallelLayout
        return ParallelLayout(rank=rank, cp=self.context_parallel_size, ep=self.expert_parallel_size,
                              attn_tp=self.lane_size, nnodes=self.nnodes)

    def resolve(self, model_config) -> EngineConfig:
        """Fill model-dependent defaults and check them against the model; returns self."""
        max_pos = int(model_config.max_position_embeddings)
        if self.max_model_len is None:
            self.max_model_len = min(max_pos, _DEFAULT_MAX_MODEL_LEN)
        elif self.max_model_len > max_pos:
            raise ValueError(
                f"max_model_len must be in [2, {max_pos}] (the model's max_position_embeddings), "
                f"got {self.max_model_len}")
        if self.world_size > 1:
            self.parallel_layout().check_model(model_config)
        if self.num_speculative_tokens:
            if getattr(model_config, "model_type", None) != "deepseek_v41" \
                    or not getattr(model_config, "num_nextn_predict_layers", 0):
                raise ValueError(
                    f"num_speculative_tokens={self.num_speculative_tokens} needs a deepseek_v41 checkpoint "
                    f"with DSpark draft layers (num_nextn_predict_layers > 0); this one is "
                    f"{getattr(model_config, 'model_type', None)!r} with "
                    f"{getattr(model_config, 'num_nextn_predict_layers', 0)} draft layers")
        return self


def engine_option_names() -> tuple[str, ...]:
    """Every EngineConfig field name: the keyword options of LLM and the engine flags of the CLI."""
    return tuple(f.name for f in dataclasses.fields(EngineConfig))


def _has_computed_default(f: dataclasses.Field) -> bool:
    return f.default_factory is not dataclasses.MISSING


def add_engine_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add one `--field-name` option per EngineConfig field, with the field's default.

    A required field (model) is a required option; a bool is a flag (`--enforce-eager`, or
    `--x/--no-x` when it defaults to True). A computed default (kv_cache_memory_bytes) is left
    None here and computed by EngineConfig when `engine_config_from_args` builds the config, at the
    same moment as for `LLM(...)`, so both read DEEPINFER_KV_CACHE_MEMORY_BYTES alike.
    """
    group = parser.add_argument_group("engine options (the keyword arguments of LLM(...))")
    for f in dataclasses.fields(EngineConfig):
        meta = f.metadata
        if "help" not in meta:
            raise TypeError(f"EngineConfig.{f.name} has no help text: declare it with _option(...)")
        flag = "--" + f.name.replace("_", "-")
        required = f.default is dataclasses.MISSING and not _has_computed_default(f)
        default = None if required or _has_computed_default(f) else f.default
        help_text = meta["help"].replace("%", "%%")  # argparse %-formats help strings
        if not required and not isinstance(default, bool):  # a flag's help says what it turns on
            shown = meta["default_text"] or ("unset" if default is None else str(default))
            help_text += f" (default: {shown})".replace("%", "%%")
        if isinstance(default, bool):
            action = argparse.BooleanOptionalAction if default else "store_true"
            group.add_argument(flag, dest=f.name, action=action, default=default, help=help_text)
            continue
        value_type = meta["value_type"] or type(default)
        if value_type is type(None):
            raise TypeError(f"EngineConfig.{f.name} defaults to None: give _option(value_type=...)")
        group.add_argument(flag, dest=f.name, type=value_type, default=default, required=required,
                           choices=meta["choices"], help=help_text)
    return parser


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig of a namespace parsed by a parser with `add_engine_args` options."""
    values = {}
    for f in dataclasses.fields(EngineConfig):
        value = getattr(args, f.name)
        if value is None and _has_computed_default(f):
            continue  # not given: EngineConfig computes it now
        values[f.name] = value
    return EngineConfig(**values)
