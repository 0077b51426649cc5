"""LLM: the offline API (vLLM names): LLM(model=...).generate(prompts, sampling_params)."""

from __future__ import annotations

import dataclasses
import inspect
import itertools

from tqdm.auto import tqdm

from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.engine_config import EngineConfig, engine_option_names


class LLM:
    """Offline batch generation over one LLMEngine.

    `LLM(model, **engine_options)`: the options are the EngineConfig fields under their names and
    with their defaults (tokenizer, dtype, max_model_len, max_num_seqs, max_num_batched_tokens,
    kv_cache_mode, kv_cache_memory_bytes, ...); the server's command line has the same ones.
    With SamplingParams(n=k) a request yields k completions; a seeded request uses seeds
    seed, seed+1, ..., seed+k-1 for them, an unseeded one derives each from the engine seed and
    the sequence id (deepinfer.sequence.effective_seed), so runs are reproducible either way.
    """

    def __init__(self, model: str, **engine_options):
        known = set(engine_option_names()) - {"model"}
        unknown = sorted(set(engine_options) - known)
        if unknown:
            raise TypeError(f"LLM got unexpected argument(s) {unknown}; engine arguments are {sorted(known)}")
        self.llm_engine = LLMEngine(EngineConfig(model=model, **engine_options))
        self._request_ids = itertools.count()

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> LLM:
        """Wrap an existing engine (tests, tools that build the engine themselves)."""
        llm = cls.__new__(cls)
        llm.llm_engine = engine
        llm._request_ids = itertools.count()
        return llm

    def close(self) -> None:
        """Stop the engine's follower processes (several ranks); also runs at interpreter exit."""
        self.llm_engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(self, prompts, sampling_params=None, use_tqdm: bool = True) -> list:
        """Generate for one prompt or a list of prompts; returns RequestOutputs in input order.

        prompts: str | list[str] | dict(prompt_token_ids=[...]) | list of such dicts
        (a bare list[int] is one token-id prompt). sampling_params: one SamplingParams for all
        prompts, or a list with one per prompt.
        """
        from deepinfer.sampling_params import SamplingParams
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(prompt_list):
                raise ValueError(
                    f"sampling_params list has {len(sampling_params)} entries but there are "
                    f"{len(prompt_list)} prompts; pass one SamplingParams or one per prompt")
            params_list = list(sampling_params)
        else:
            params_list = [sampling_params] * len(prompt_list)

        engine = self.llm_engine
        request_ids: list[str] = []
        try:
            # All or nothing: a bad prompt rejects the whole call and leaves the engine idle.
            for prompt, params in zip(prompt_list, params_list):
                request_id = str(next(self._request_ids))
                engine.add_request(request_id, prompt, params)
                request_ids.append(request_id)
            results = self._run(request_ids, use_tqdm)
        except BaseException:
            for request_id in request_ids:
                engine.abort_request(request_id)
            raise
        return [results[r] for r in request_ids]

    def _run(self, request_ids: list[str], use_tqdm: bool) -> dict:
        engine = self.llm_engine
        pending = set(request_ids)
        results = {}
        num_generated = 0
        with tqdm(total=len(request_ids), desc="Processed prompts", unit="req",
                  disable=not use_tqdm, dynamic_ncols=True) as bar:
            while pending and engine.has_unfinished_requests():
                outputs = engine.step()
                num_generated += engine.last_step_timing.num_sampled
                for out in outputs:
                    if out.finished and out.request_id in pending:
                        results[out.request_id] = out
                        pending.discard(out.request_id)
                        bar.update(1)
                if bar.format_dict.get("elapsed"):
                    bar.set_postfix_str(f"output {num_generated / bar.format_dict['elapsed']:.1f} tok/s",
                                        refresh=False)
        assert not pending, f"engine stopped with unfinished requests {sorted(pending)}"
        return results


class _ComputedDefault:
    """Stands for a default EngineConfig computes at construction (shown by help(LLM))."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return f"<{self.text}>"


def _init_signature() -> inspect.Signature:
    """LLM.__init__'s signature as help() and editors show it: model, then every engine option."""
    kind = inspect.Parameter.KEYWORD_ONLY
    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
              inspect.Parameter("model", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation="str")]
    for f in dataclasses.fields(EngineConfig):
        if f.name == "model":
            continue
        default = f.default
        if default is dataclasses.MISSING:
            default = _ComputedDefault(f.metadata["default_text"] or "computed")
        params.append(inspect.Parameter(f.name, kind, default=default, annotation=f.type))
    return inspect.Signature(params)


LLM.__init__.__signature__ = _init_signature()


def _as_prompt_list(prompts) -> list:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, (list, tuple)):
        if not prompts:
            raise ValueError("prompts must not be an empty list")
        if all(isinstance(p, int) and not isinstance(p, bool) for p in prompts):
            return [list(prompts)]  # one prompt given as token ids
        return list(prompts)
    raise ValueError(
        f"prompts must be a str, a list of str, a dict with prompt_token_ids or a list of dicts, "
        f"got {type(prompts).__name__}")
