"""Safetensors checkpoint -> dense tensors under the canonical names (docs/model.md §2).

Accepts one `model.safetensors`, shards with `model.safetensors.index.json`, or a folder of shards;
names with or without a `model.` prefix; official DeepSeek names and transformers names (docs/model.md
§2.3, including the stacked `experts.gate_up_proj` / `down_proj`). Dequantizes FP8 weights (scale as
`X.scale` ue8m0 / f32 or `X.weight_scale_inv`), packed FP4 experts and the Engram table (zero rows
appended up to the model's row count; a table padded to a multiple of 256 rows is cut back).
Vision tensors are ignored. Anything missing, unknown or malformed raises ValueError naming the
tensor with the expected and the found shape / dtype; nothing is loaded until the whole plan checks.

The package holds one concept a file: scan.py (files and headers), names.py (canonical names),
formats.py (stored formats and shape checks), plan.py (the load plan), decode.py (reading), load.py
(the entry points).
"""

from deepinfer.model_executor.checkpoint_formats import is_fp32_tensor
from deepinfer.model_executor.loader.formats import stored_formats
from deepinfer.model_executor.loader.load import load_checkpoint, load_weights
from deepinfer.model_executor.loader.names import tf_to_canonical

__all__ = ["is_fp32_tensor", "load_checkpoint", "load_weights", "stored_formats", "tf_to_canonical"]
