"""KV cache: paged pools + per-layer page tables (``megac.abi.KV_LAYOUT``)."""

from megac.kv.paged import BlockAllocator, KVOutOfBlocks, PagedKVCache, blocks_for_tokens, peak_blocks_for_tokens

__all__ = ["BlockAllocator", "KVOutOfBlocks", "PagedKVCache", "blocks_for_tokens", "peak_blocks_for_tokens"]
