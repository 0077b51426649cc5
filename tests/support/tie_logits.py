"""Verification logits whose maxima tie exactly or by one ulp, and drafts that hit, miss and stop, for
comparing the greedy acceptance rules (tests/unit/test_greedy_accept.py, tests/unit/test_argmax_verify.py)."""
import torch

from deepinfer.spec.verify import NO_TOKEN

V = 300   # more than two of first_argmax's 128-value blocks, and a tail block


def near_tie_logits(r: int, depth: int, seed: int) -> torch.Tensor:
    """[R, depth, V]: each row's maximum shared with another id (exact tie), or beaten by one ulp, in
    the same or another 128-value block, the tail block included."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(r, depth, V, generator=g)
    for i in range(r):
        for j in range(depth):
            a, b = sorted(torch.randperm(V, generator=g)[:2].tolist())
            top = float(x[i, j].max()) + 1.0
            x[i, j, a] = top
            kind = (i + j) % 3
            if kind == 0:
                x[i, j, b] = top                                     # exact tie: the lower id a wins
            elif kind == 1:
                x[i, j, b] = torch.nextafter(torch.tensor(top), torch.tensor(float("inf")))  # b by one ulp
            else:
                x[i, j, b] = torch.nextafter(torch.tensor(top), torch.tensor(float("-inf")))  # a by one ulp
    return x


def tie_drafts(logits: torch.Tensor, seed: int) -> torch.Tensor:
    """Drafts that are the argmax, the tie's other id, another token, or none, per depth."""
    g = torch.Generator().manual_seed(seed)
    r, depth, _ = logits.shape
    top = logits.argmax(dim=-1)
    d = torch.empty(r, depth - 1, dtype=torch.long)
    for i in range(r):
        for j in range(depth - 1):
            u = float(torch.rand(1, generator=g))
            if u < 0.6:
                d[i, j] = top[i, j]
            elif u < 0.8:   # the other id of the row's top two (the loser of the tie)
                d[i, j] = logits[i, j].topk(2).indices[1]
            elif u < 0.9:
                d[i, j] = (top[i, j] + 1) % V
            else:
                d[i, j] = NO_TOKEN
    for i in range(r):   # a row without a draft at some depth has none after it either
        none = (d[i] == NO_TOKEN).nonzero()
        if none.numel():
            d[i, int(none[0]):] = NO_TOKEN
    return d
