"""Paged KV cache bookkeeping, pure Python.

Block 0 is reserved: padding tokens write their K/V there and read from it, so a
padded step never touches a real sequence's cache. Real sequences get blocks
1..num_blocks-1.
"""

from __future__ import annotations

from collections import deque

from vllm_tpu_lora.engine.sequence import Sequence

NULL_BLOCK = 0


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"need at least 2 KV blocks (one is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(1, num_blocks))
        self._owner: dict[int, int] = {}  # block -> seq_id, to catch double frees

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

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
            block = self._free.popleft()
            self._owner[block] = seq.seq_id
            seq.block_ids.append(block)

    def free(self, seq: Sequence) -> None:
        for block in seq.block_ids:
            if self._owner.pop(block, None) != seq.seq_id:
                raise RuntimeError(f"block {block} freed by seq {seq.seq_id} that does not own it")
            self._free.append(block)
        seq.block_ids = []

    def slot(self, seq: Sequence, position: int) -> int:
        """Flat cache slot of token `position` of `seq`."""
        block = seq.block_ids[position // self.block_size]
        return block * self.block_size + position % self.block_size
