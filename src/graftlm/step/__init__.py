"""What one forward step reads and writes: the batch (rows, positions, per-row adapter scales)
and the KV cache. Below the models, which take both; above nothing of graftlm's but torch."""

from graftlm.step.batch import Batch, LoraRows, RowIndex
from graftlm.step.kv_cache import KVCache

__all__ = ["Batch", "KVCache", "LoraRows", "RowIndex"]
