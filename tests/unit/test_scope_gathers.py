"""tools/scope_gathers.py: the compressed-cache gathers of a prompt chunk, on meta. With the shared
scope every index source reads its keys once, [E] rows; per row it reads [tokens, E] more (the
scope gather comes first either way), and the attention's record gathers do not change."""
from deepinfer.tools.scope_gathers import chunk_gathers
from tests.support.model_helpers import tiny_config


def test_the_scope_gathers_the_index_keys_once_per_chunk():
    cfg = tiny_config("v41")
    tokens = 64
    scope = chunk_gathers(cfg, context=256, tokens=tokens)
    per_row = chunk_gathers(cfg, context=256, tokens=tokens, indexer_per_row=True)
    assert scope["bytes"]["index_keys"] > 0 and scope["bytes"]["entries"] > 0
    assert per_row["bytes"]["index_keys"] == (tokens + 1) * scope["bytes"]["index_keys"]
    assert per_row["bytes"]["entries"] == scope["bytes"]["entries"]
    assert per_row["largest"]["index_keys"] > scope["largest"]["index_keys"]
