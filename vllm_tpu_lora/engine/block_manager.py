"""Paged KV cache bookkeeping, pure Python, with automatic prefix caching.

Block 0 is reserved: padding tokens write their K/V there and read from it, so a
padded step never touches a real sequence's cache. Real sequences get blocks
1..num_blocks-1.

Prefix caching (vLLM V1's design): a block that a sequence has filled completely is
registered under its hash (prefix_hash: the chain of token ids, rooted in the adapter's
weights and the cache_salt). A later sequence whose known tokens start with the same
blocks takes them by reference instead of computing them. Blocks are reference counted;
a block nobody references is free, and if it is registered it keeps its content and stays
findable until the space is needed: the free queue hands out the least recently freed
block first, dropping its registration then. A sequence frees its blocks last-first, so a
prompt's tail is evicted before the head that other prompts are likelier to share. Only
full blocks are shared, and a sequence only writes at or past its first uncached token,
so a shared block is never written.
"""

from __future__ import annotations

from collections import OrderedDict

from vllm_tpu_lora.engine.sequence import Sequence

NULL_BLOCK = 0


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False) -> None:
        if num_blocks < 2:
            raise ValueError(f"need at least 2 KV blocks (one is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        # Free blocks, least recently freed first (dict order): allocation pops the front.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        self._refs = [0] * num_blocks
        self._hash_of: dict[int, bytes] = {}  # registered block -> its hash
        self._block_of: dict[bytes, int] = {}  # hash -> the block holding that content
        self.num_cache_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds (cached content included: it is evicted on demand)."""
        return len(self._free)

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_cached_blocks(self) -> int:
        return len(self._block_of)

    def num_new_blocks(self, seq: Sequence, total_tokens: int) -> int:
        """Blocks `seq` must gain so its first `total_tokens` tokens have slots."""
        return max(0, blocks_needed(total_tokens, self.block_size) - len(seq.block_ids))

    def can_grow(self, seq: Sequence, total_tokens: int) -> bool:
        return self.num_new_blocks(seq, total_tokens) <= len(self._free)

    def grow(self, seq: Sequence, total_tokens: int) -> None:
        need = self.num_new_blocks(seq, total_tokens)
        if need > len(self._free):
            raise RuntimeError(f"out of KV blocks: need {need}, have {len(self._free)}")
        for _ in range(need):
            block, _ = self._free.popitem(last=False)
            self._forget(block)
            self._refs[block] = 1
            seq.block_ids.append(block)

    def free(self, seq: Sequence) -> None:
        for block in seq.block_ids:
            if self._refs[block] <= 0:
                raise RuntimeError(f"block {block} freed by seq {seq.seq_id} that does not own it")
        for block in reversed(seq.block_ids):  # tail first: evicted before the shared head
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._free[block] = None
        seq.block_ids = []
        seq.num_cached_blocks = 0

    def slot(self, seq: Sequence, position: int) -> int:
        """Flat cache slot of token `position` of `seq`."""
        block = seq.block_ids[position // self.block_size]
        return block * self.block_size + position % self.block_size

    # ---- prefix caching ----

    def cached_prefix(self, hashes: list[bytes]) -> list[int]:
        """The blocks holding the longest registered prefix of `hashes`."""
        blocks = []
        for h in hashes:
            block = self._block_of.get(h)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def can_take(self, seq: Sequence, cached: list[int], total_tokens: int) -> bool:
        """Whether `seq` (holding no blocks) can take `cached` and grow to `total_tokens`:
        cached blocks that are free leave the free pool too."""
        reused_free = sum(1 for b in cached if self._refs[b] == 0)
        new = max(0, blocks_needed(total_tokens, self.block_size) - len(cached))
        return new + reused_free <= len(self._free)

    def take(self, seq: Sequence, cached: list[int]) -> None:
        """Give `seq` (holding no blocks) the cached blocks `cached` as its first blocks."""
        assert not seq.block_ids, "take() starts a sequence's block table"
        for block in cached:
            if self._refs[block] == 0:
                del self._free[block]
            self._refs[block] += 1
        seq.block_ids = list(cached)
        seq.num_cached_blocks = len(cached)

    def register_full_blocks(self, seq: Sequence, hashes: list[bytes]) -> None:
        """Register `seq`'s blocks [num_cached_blocks, len(hashes)) whose K/V it has just
        completed. Content already registered in another block stays there (this copy is
        freed as plain space later)."""
        for i in range(seq.num_cached_blocks, len(hashes)):
            block, h = seq.block_ids[i], hashes[i]
            if h not in self._block_of and block not in self._hash_of:
                self._block_of[h] = block
                self._hash_of[block] = h
        seq.num_cached_blocks = max(seq.num_cached_blocks, len(hashes))

    def reset_prefix_cache(self) -> int:
        """Forget every registration (blocks in use keep their content for their holders,
        free ones become plain space). Returns how many blocks were registered."""
        dropped = len(self._block_of)
        self._block_of.clear()
        self._hash_of.clear()
        return dropped

    def _forget(self, block: int) -> None:
        h = self._hash_of.pop(block, None)
        if h is not None:
            del self._block_of[h]
            self.num_cache_evictions += 1
