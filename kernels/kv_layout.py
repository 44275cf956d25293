"""The paged KV cache's layout: what two workers must agree on before KV blocks move between
them. Lives in ``kernels`` (which imports nothing of ``services``) so the engine, which builds
the cache, and the KV transport, which moves its blocks, can both import it."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVCacheLayout:
    """What two workers must agree on before KV blocks can move between them.

    The KV cache of a worker is one tensor of shape
    ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`` (index 0 of the second
    axis is K, 1 is V), so each (layer, K/V, block) is one contiguous region of
    ``block_size * num_kv_heads * head_dim * itemsize`` bytes.
    """

    num_layers: int
    block_size: int  # tokens per block
    num_kv_heads: int
    head_dim: int
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "float32"

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of one layer's K (or V)."""
        itemsize = torch.empty((), dtype=self.torch_dtype).element_size()
        return self.block_size * self.num_kv_heads * self.head_dim * itemsize

    @classmethod
    def of(cls, model, block_size: int, dtype: torch.dtype) -> KVCacheLayout:
        """The layout of ``model``'s KV cache (any config with Hugging Face ``LlamaConfig``
        field names: ``num_hidden_layers``, ``num_key_value_heads``, ``head_dim``) in
        ``block_size``-token blocks of ``dtype``."""
        return cls(
            num_layers=model.num_hidden_layers,
            block_size=block_size,
            num_kv_heads=model.num_key_value_heads,
            head_dim=model.head_dim,
            dtype=str(dtype).removeprefix("torch."),
        )
