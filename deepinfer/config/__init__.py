"""ModelConfig: the checkpoint's config.json, normalized and validated (docs/model.md §1).

Both spellings of V4 are accepted: the official DeepSeek keys (`compress_ratios` 0/4/128 possibly
listing L + nextn entries, `num_hash_layers`, `qk_rope_head_dim`, `rope_scaling`) and the
transformers-normalised ones (`layer_types`, `mlp_layer_types`, `compress_rates`,
`partial_rotary_factor`, `rope_parameters`). V4.1 keeps its model keys in `text_config`.
Every rule of docs/model.md §1.3 is checked here, so the model can trust the attributes.

fields.py holds the typed readers and the fields both dialects share, v4.py and v41.py one dialect
each, model_config.py the ModelConfig dataclass.
"""

from deepinfer.config.fields import CSA, HCA, SWA, V4, V41, source_map
from deepinfer.config.model_config import ModelConfig

__all__ = ["CSA", "HCA", "SWA", "V4", "V41", "ModelConfig", "source_map"]
