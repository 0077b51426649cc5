"""Static-shape steps shared by the graph runners (CUDA graphs, Neuron region graphs; docs/architecture.md §3, docs/neuron.md §5.1, §5.3).

A static step's graphs depend only on (tokens T, context limit C): T is the batch bucket for decode
steps (the platform's row buckets) or the prefill bucket for steps with a prompt chunk
(prompt-as-decode: every token gets decode-layout metadata, padded with placeholder rows), and C
is the smallest context bucket that holds every sequence. `pad_step` then gives every
data-dependent length of `StepInputs` a static size:
- SWA and compressor-state writes: T (extra writes go to scratch slot 0);
- new compressed entries: `entry_cap(T, m)` (extra entries pool scratch rows into block 0);
- visible-entry tables [T, maxE]: C // m columns (extra columns invalid, pointing at row 0).
- logits rows: optionally a fixed count (a whole-forward graph returns the same shape every step);
  extra rows read token 0 and are sliced off by the runner.
Padding only ever reads finite scratch rows and writes slot 0 / block 0, never a real sequence's.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from deepinfer.model_executor.forward_meta import CacheLayout, CompressMeta, SeqChunk, StepInputs, build_step_inputs

MIN_CONTEXT_BUCKET = 64  # smallest default context bucket (tiny prompts do not each get a graph)


@dataclass(frozen=True)
class Bucket:
    num_seqs: int
    num_tokens: int
    context: int = 0  # max context length the padded dense inputs are sized for (0 = unbounded)


def pad_chunks(chunks: list[SeqChunk], bucket: Bucket | None) -> list[SeqChunk]:
    """Append placeholder rows (scratch slot/block, token 0, positions from 0) up to the bucket."""
    if bucket is None:
        return chunks
    extra_seqs = bucket.num_seqs - len(chunks)
    extra_tokens = bucket.num_tokens - sum(c.num_new for c in chunks)
    if extra_seqs < 0 or extra_tokens < extra_seqs:
        raise ValueError(f"step does not fit bucket {bucket}")
    padded = list(chunks)
    for i in range(extra_seqs):  # the extra tokens spread evenly (decode buckets: one each)
        n = extra_tokens // extra_seqs + (1 if i < extra_tokens % extra_seqs else 0)
        padded.append(SeqChunk(slot=0, ctx_len=0, num_new=n, block_table=[0], token_ids=[0] * n, num_logits=0))
    return padded


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def draft_block_tokens(rows: int, depth: int) -> int:
    """Tokens a compiled DSpark draft block of `rows` rows and `depth` tokens a row runs as: rows x
    depth up to a power of two (docs/neuron.md §4 B3); the compile plan and the runner both ask here."""
    return next_pow2(rows * depth)


def entry_cap(num_tokens: int, ratio: int, seqs_bound: int) -> int:
    """Upper bound of new compressed entries in a T-token step: a sequence feeding n tokens closes
    at most n // m + 1 entries and at most n, and a step holds at most `seqs_bound` sequences."""
    return min(num_tokens, seqs_bound + num_tokens // ratio)


@dataclass(frozen=True)
class BucketSpec:
    batch: tuple[int, ...]                # decode row buckets
    contexts: tuple[int, ...] | None      # explicit context buckets (only Neuron sets them:
                                          # DEEPINFER_NEURON_CTX_BUCKETS, so the messages name it)
    prefill_tokens: tuple[int, ...] | None  # prompt-chunk buckets (DEEPINFER_NEURON_PREFILL_BUCKET), an int
                                            # is one bucket; None: prompt steps run eagerly
    max_model_len: int | None = None
    verify_tokens: int = 1  # tokens of a speculative verification row (1 + drafts); 1 = no verify buckets
    # Every bucket's token count a power of two (Neuron, docs/neuron.md §4 B3): prompt buckets are
    # rounded up, verification buckets of R x (1 + B) tokens padded up with placeholder rows.
    pow2_tokens: bool = False
    # The row buckets with a verification bucket (None: every row bucket). A verification step with more
    # rows than the largest runs in a prompt bucket (Neuron keeps its compile budget so, §5.10).
    verify_rows: tuple[int, ...] | None = None
    # A verification bucket's tokens rounded further up to the smallest row bucket that holds them, so
    # that it is a decode bucket's token count and shares its graphs (Neuron, §5.10): 8 x 2 = 16 -> 64.
    verify_shares_decode: bool = False

    def __post_init__(self):
        if not self.batch or any(b < 1 for b in self.batch):
            raise ValueError(f"batch buckets: must be positive, got {self.batch}")
        if self.pow2_tokens and any(b != next_pow2(b) for b in self.batch):
            raise ValueError(f"DEEPINFER_NEURON_ROW_BUCKETS: row buckets must be powers of two (docs/neuron.md "
                             f"§4 B3), got {self.batch}")
        if self.verify_rows is not None and not set(self.verify_rows) <= set(self.batch):
            raise ValueError(f"DEEPINFER_NEURON_VERIFY_ROWS: each must be one of the row buckets {self.batch}, "
                             f"got {self.verify_rows}")
        if self.contexts is not None and (not self.contexts or any(c < 1 for c in self.contexts)):
            raise ValueError(f"DEEPINFER_NEURON_CTX_BUCKETS: must be positive integers, got {self.contexts}")
        if isinstance(self.prefill_tokens, int):
            object.__setattr__(self, "prefill_tokens", (self.prefill_tokens,))
        if self.prefill_tokens is not None:
            if any(p < 2 for p in self.prefill_tokens) or not self.prefill_tokens:
                raise ValueError(f"DEEPINFER_NEURON_PREFILL_BUCKET: must be >= 2, got {self.prefill_tokens}")
            round_up = next_pow2 if self.pow2_tokens else int
            object.__setattr__(self, "prefill_tokens", tuple(sorted({round_up(p) for p in self.prefill_tokens})))
        if self.contexts is not None and self.max_model_len is not None and max(self.contexts) < self.max_model_len:
            raise ValueError(f"DEEPINFER_NEURON_CTX_BUCKETS: the largest bucket ({max(self.contexts)}) must be "
                             f">= max_model_len ({self.max_model_len})")

    @property
    def verify_batch(self) -> tuple[int, ...]:
        """The row buckets that get a verification bucket (verify_rows, else every row bucket)."""
        return self.batch if self.verify_rows is None else tuple(sorted(self.verify_rows))

    @property
    def seqs_bound(self) -> int:
        """Real rows plus one: bounds the entries a step closes beyond tokens // m (each real chunk
        closes at most one more; placeholder chunks start at position 0 and close exactly n // m)."""
        return max(self.batch) + 1

    def verify_bucket_tokens(self, rows: int) -> int:
        """Tokens of the verification bucket of `rows` rows: rows x (1 + B), or the next power of two, or
        the decode bucket's token count that holds it (verify_shares_decode)."""
        t = rows * self.verify_tokens
        t = next_pow2(t) if self.pow2_tokens else t
        if self.verify_shares_decode:
            t = min((b for b in self.batch if b >= t), default=t)
        return t

    def context_bucket(self, need: int) -> int | None:
        if self.contexts is not None:
            return next((c for c in sorted(self.contexts) if c >= need), None)
        c = max(MIN_CONTEXT_BUCKET, next_pow2(need))
        if self.max_model_len is not None and need <= self.max_model_len:
            c = min(c, max(self.max_model_len, MIN_CONTEXT_BUCKET))
        return c

    def context_ladder(self) -> tuple[int, ...]:
        """Every context bucket a step can select (explicit, or the powers of two up to max_model_len)."""
        if self.contexts is not None:
            return tuple(sorted(self.contexts))
        if self.max_model_len is None:
            raise ValueError("warm-up: the context buckets are unbounded (set max_model_len or "
                             "DEEPINFER_NEURON_CTX_BUCKETS)")
        needs = [self.max_model_len] + [1 << k for k in range(self.max_model_len.bit_length())]
        return tuple(sorted({self.context_bucket(n) for n in needs if n <= self.max_model_len}))

    def all_buckets(self) -> list[Bucket]:
        """Every bucket `select` can return, as placeholder-only buckets (warm-up): decode rows, then
        prompt buckets whose placeholder chunks each fit the context bucket."""
        out = []
        q = self.verify_tokens
        for ctx in self.context_ladder():
            out += [Bucket(num_seqs=b, num_tokens=b, context=ctx) for b in self.batch]
            out += [self._verify_bucket([], b, ctx) for b in self.verify_batch if q > 1]
            out += [Bucket(num_seqs=-(-p // ctx), num_tokens=p, context=ctx) for p in self.prefill_tokens or ()]
        return out

    def static_step(self, chunks: list[SeqChunk], bucket: Bucket, layout: CacheLayout,
                    logits_rows: int | None = None) -> StepInputs:
        """The host-built step of `chunks` padded to `bucket`: placeholder rows, then static sizes."""
        # A bucket of a decode bucket's token count carries no shared scope (forward_meta.CompressMeta.
        # scope_idx), as decode steps have none: a region graph is one per (region, kind, tokens,
        # context) (platforms/neuron/compile_plan.py), so e.g. a verification bucket sharing the decode
        # graphs (verify_shares_decode) must give them the same inputs. Whether a step has a scope thus
        # depends on its token count alone.
        scoped = bucket.num_tokens not in self.batch
        step = build_step_inputs(pad_chunks(chunks, bucket), layout, shared_scope=scoped, seq_scopes=False)
        return pad_step(step, bucket, self.seqs_bound, logits_rows=logits_rows)

    def select(self, chunks: list[SeqChunk]) -> Bucket | None:
        """The bucket a step runs in, or None when it fits none (the runner then runs it eagerly)."""
        if not chunks:
            return None
        n = len(chunks)
        tokens = sum(c.num_new for c in chunks)
        ctx = self.context_bucket(max(c.ctx_len + c.num_new for c in chunks))
        if ctx is None:
            return None
        if all(c.num_new == 1 for c in chunks):
            rows = next((b for b in self.batch if b >= n), None)
            return None if rows is None else Bucket(num_seqs=rows, num_tokens=rows, context=ctx)
        q = self.verify_tokens
        if q > 1 and all(c.num_new <= q for c in chunks):
            # Verification rows: a row bucket of q tokens a row (docs/neuron.md §5.1)
            rows = next((b for b in self.verify_batch if b >= n), None)
            if rows is not None:
                return self._verify_bucket(chunks, rows, ctx)
        p = next((b for b in self.prefill_tokens or () if b >= tokens), None)
        if p is None:
            return None
        # The placeholder tokens go to chunks of at most `ctx` tokens, each starting at position 0,
        # so their own positions never need a larger context bucket than the real rows.
        return Bucket(num_seqs=n - (-(p - tokens) // ctx), num_tokens=p, context=ctx)

    def common_buckets(self, groups: list[list[SeqChunk]]) -> list[Bucket | None]:
        """One bucket per data-parallel group of a step (each group's real chunks, possibly none), all
        of one token count: every rank of an EP group feeds its MoE collectives (and a lane its
        all-reduce) the same rows, so groups must not pick buckets of different sizes, as they would when
        one group's rows fit a verification bucket and another's a prompt or a smaller bucket. Every
        group takes the largest group's token count and class, its own context; the bucket's placeholders
        fill the difference (static_step). A verification-sized count becomes the prompt bucket that holds
        it when some group has a chunk longer than a verification row. Where a group with chunks fits no
        bucket, every group runs eagerly (all None)."""
        chosen = [self.select(g) if g else None for g in groups]
        if any(b is None for g, b in zip(groups, chosen) if g) or not any(groups):
            return [None] * len(groups)
        top = max((b for b in chosen if b is not None), key=lambda b: (b.num_tokens, b.num_seqs))
        t, ctx_any = top.num_tokens, max(b.context for b in chosen if b is not None)
        # a decode bucket has one token a row (num_seqs == num_tokens): its class is its own
        if all(b is not None and b.num_tokens == t for b in chosen) and \
                len({b.num_seqs == b.num_tokens for b in chosen}) == 1:
            return chosen
        decode = top.num_seqs == top.num_tokens and all(c.num_new == 1 for g in groups for c in g)
        verify = self.verify_tokens > 1 and t in {self.verify_bucket_tokens(r) for r in self.verify_batch}
        prompt = self.prefill_tokens or ()
        if not decode and verify and t not in prompt and any(c.num_new > self.verify_tokens for g in groups for c in g):
            t = next((p for p in prompt if p >= t), None)
            if t is None:
                return [None] * len(groups)
        out = []
        for g, b in zip(groups, chosen):
            ctx = ctx_any if b is None else b.context
            if decode:
                out.append(Bucket(num_seqs=t, num_tokens=t, context=ctx))
            elif b is not None and b.num_tokens == t and b.num_seqs != b.num_tokens:
                out.append(b)   # its own bucket is already of the common count and class
            else:   # the common count, placeholders for the rest (as select's prompt buckets)
                extra = t - sum(c.num_new for c in g)
                out.append(Bucket(num_seqs=len(g) - (-extra // ctx), num_tokens=t, context=ctx))
        return out

    def _verify_bucket(self, chunks: list[SeqChunk], rows: int, ctx: int) -> Bucket:
        """The verification bucket of `rows` row slots holding `chunks`: the tokens short rows, empty
        row slots and the power-of-two padding leave over go to placeholder chunks of at most `ctx`
        tokens each (their positions never need a larger context bucket); with no chunks (warm-up)
        every row slot is a placeholder."""
        t = self.verify_bucket_tokens(rows)
        extra = t - sum(c.num_new for c in chunks)
        seqs = max(rows, -(-extra // ctx)) if not chunks else len(chunks) + (-(-extra // ctx))
        return Bucket(num_seqs=seqs, num_tokens=t, context=ctx)


def _pad_writes(src: torch.Tensor, dst: torch.Tensor, n: int, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    extra = n - src.numel()
    if extra < 0:
        raise ValueError(f"{what}: {src.numel()} writes exceed the static size {n}")
    # row 0 of a ring is slot 0 (scratch); source token 0 always exists
    return F.pad(src, (0, extra)), F.pad(dst, (0, extra))


def _pad_meta(m: CompressMeta, num_tokens: int, context: int, seqs_bound: int) -> CompressMeta:
    cap = entry_cap(num_tokens, m.ratio, seqs_bound)
    extra = cap - m.entry_dst.numel()
    if extra < 0:
        raise ValueError(f"compressor ratio {m.ratio}: {m.entry_dst.numel()} new entries exceed the cap {cap}")
    width = context // m.ratio
    if m.vis_idx.shape[1] > width:
        raise ValueError(f"compressor ratio {m.ratio}: {m.vis_idx.shape[1]} visible entries exceed the "
                         f"context bucket {context}")
    grow = width - m.vis_idx.shape[1]
    state_src, state_dst = _pad_writes(m.state_src, m.state_dst, num_tokens, f"ratio {m.ratio} state")
    return dataclasses.replace(
        m,
        # pooled from scratch state row 0, all slots valid (an all-invalid softmax would be NaN)
        src_idx=F.pad(m.src_idx, (0, 0, 0, extra)),
        src_valid=F.pad(m.src_valid, (0, 0, 0, extra), value=True),
        entry_pos=F.pad(m.entry_pos, (0, extra)),
        entry_dst=F.pad(m.entry_dst, (0, extra)),          # row 0 = block 0 (scratch)
        state_src=state_src, state_dst=state_dst,
        vis_idx=F.pad(m.vis_idx, (0, grow)),
        vis_valid=F.pad(m.vis_valid, (0, grow), value=False),
        scope_idx=None if m.scope_idx is None else F.pad(m.scope_idx, (0, grow)))


def pad_step(step: StepInputs, bucket: Bucket, seqs_bound: int, logits_rows: int | None = None) -> StepInputs:
    """Static-size copy of a step built from padded chunks (see the module docstring)."""
    t = bucket.num_tokens
    if step.num_tokens != t:
        raise ValueError(f"step has {step.num_tokens} tokens, bucket {bucket} expects {t}")
    src, dst = _pad_writes(step.swa_write_src, step.swa_write_dst, t, "SWA")
    comp = {key: _pad_meta(m, t, bucket.context, seqs_bound) for key, m in step.comp.items()}
    logits = step.logits_indices
    if logits_rows is not None:
        if logits.numel() > logits_rows:
            raise ValueError(f"{logits.numel()} logits rows exceed the static size {logits_rows}")
        logits = F.pad(logits, (0, logits_rows - logits.numel()))
    return dataclasses.replace(step, swa_write_src=src, swa_write_dst=dst, comp=comp, logits_indices=logits,
                               static_shapes=True)


def static_signature(step: StepInputs) -> tuple:
    """Everything a captured graph bakes in: each tensor's shape and dtype, every other field's value.
    Two steps with equal signatures can replay the same graph."""
    def fields(obj, prefix=""):
        out = []
        for f in dataclasses.fields(obj):
            v = getattr(obj, f.name)
            if isinstance(v, torch.Tensor):
                out.append((prefix + f.name, tuple(v.shape), v.dtype))
            elif isinstance(v, dict):
                for key in sorted(v, key=repr):
                    out += fields(v[key], f"{prefix}{f.name}[{key!r}].")
            else:
                out.append((prefix + f.name, v))
        return out
    return tuple(fields(step))
