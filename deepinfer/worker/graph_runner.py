"""GraphRunner contract: pick a bucket for a step, pad the step to it, run the model, slice.

The eager runner needs no buckets: it runs the step as it is. Static-shape runners (CUDA graphs,
Neuron compiled graphs) pad rows with placeholder tokens that read and write only the scratch slot
and scratch block (slot 0 / block 0), then slice the real rows back out. Multi-token decode rows
(speculative verification) are ordinary rows with num_new > 1 and num_logits > 1.
"""
import torch

from deepinfer.model_executor.forward_meta import CacheLayout, SeqChunk, StepInputs, build_step_inputs, step_to
from deepinfer.worker.static_step import Bucket, pad_chunks


class GraphRunner:
    """Base class. Subclasses override `select_bucket` and `execute`."""

    def __init__(self, model, layout: CacheLayout):
        self.model = model
        self.layout = layout
        # metadata is built on the host and copied to the model's device once per step
        param = next(model.parameters(), None) if model is not None else None
        self.device = param.device if param is not None else torch.device("cpu")

    @classmethod
    def for_platform(cls, platform):
        """The class with `platform` bound (what a platform's graph_runner_cls returns)."""
        def make(model, layout, **kw):
            return cls(model, layout, platform=platform, **kw)
        make.__name__ = cls.__name__
        return make

    def select_bucket(self, chunks: list[SeqChunk]) -> Bucket | None:
        return None

    def prepare(self, chunks: list[SeqChunk]) -> tuple[StepInputs, Bucket | None]:
        bucket = self.select_bucket(chunks)
        return step_to(build_step_inputs(pad_chunks(chunks, bucket), self.layout), self.device), bucket

    def execute(self, step: StepInputs, cache, bucket: Bucket | None) -> torch.Tensor:
        raise NotImplementedError

    def warm_up(self, cache) -> int:
        """Build every bucket's graph now, from placeholder rows (scratch slot / block only); returns
        the number of graphs this runner holds. The eager runner has none."""
        return 0

    def run(self, chunks: list[SeqChunk], cache) -> torch.Tensor:
        """Logits [sum of num_logits over the real chunks, vocab] in chunk order."""
        step, bucket = self.prepare(chunks)
        logits = self.execute(step, cache, bucket)
        n_real = sum(min(c.num_logits, c.num_new) for c in chunks)
        return logits[:n_real]


class EagerRunner(GraphRunner):
    def execute(self, step: StepInputs, cache, bucket: Bucket | None) -> torch.Tensor:
        return self.model(step, cache)
