"""A compiled region writes LayerIO fields on both sides of a torch.cond (models/v4_common.py
LayerIO): a target layer's `target_out` before the indexer's scope_branch, its `topk_out` and
`candidates_out` after. Both writes must reach the eager caller (DecoderLayer.collect), and a read
after the cond must see the later write."""
import pytest
import torch

from deepinfer.model_executor.layers.row_chunks import scope_branch
from deepinfer.model_executor.models.v4_common import LayerIO


def _region(x, io, in_scope):
    io.target_out = x - 1                     # before the cond, as DecoderLayer.attn_in writes it
    sel = scope_branch(in_scope, lambda x: (x + 1,), lambda x: (x * 2,), (x,))[0]
    io.topk_out = sel                         # after it, as Attention._select writes the selection
    io.candidates_out = io.topk_out + 10      # a read of the later write, inside the graph
    return sel


def test_writes_on_both_sides_of_a_cond_reach_the_caller():
    torch._dynamo.reset()
    compiled = torch.compile(_region, backend="aot_eager", fullgraph=True, dynamic=False)
    x = torch.arange(3.0)
    for in_scope, sel in ((torch.tensor([True, True]), x + 1), (torch.tensor([True, False]), x * 2)):
        io = LayerIO(swa=torch.zeros(1), fmt=None)
        assert torch.equal(compiled(x, io, in_scope), sel)
        assert torch.equal(io.target_out, x - 1)
        assert io.topk_out is not None and torch.equal(io.topk_out, sel)
        assert torch.equal(io.candidates_out, sel + 10)


def test_layer_io_takes_no_attribute_outside_its_fields():
    """Slots: a misspelt output field fails at once instead of being dropped by collect."""
    io = LayerIO(swa=torch.zeros(1), fmt=None)
    with pytest.raises(AttributeError):
        io.topk_outt = torch.zeros(1)
