"""Which rows of given weight stacks a piece of torch code reads (tests of the active-experts forms)."""
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class WeightReads(TorchDispatchMode):
    """Which rows of the tracked weight stacks each op reads: index_select by its ids, any other
    op (that does not return a view of them) the whole stack."""

    def __init__(self, stacks):
        super().__init__()
        self.keys = {t.untyped_storage()._cdata for t in stacks}
        self.rows, self.whole = set(), []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        aliased = {t.untyped_storage()._cdata for t in tree_leaves(out) if isinstance(t, torch.Tensor)}
        for a in tree_leaves((args, kwargs or {})):
            if isinstance(a, torch.Tensor) and a.untyped_storage()._cdata in self.keys - aliased:
                if str(func) == "aten.index_select.default":
                    self.rows.update(args[2].tolist())
                else:
                    self.whole.append(str(func))
        return out
