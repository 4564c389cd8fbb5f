"""Which KV blocks each sequence owns: allocation, freeing, and the block tables the kernels read."""

from __future__ import annotations

import heapq

import numpy as np

from harli_train.engine.sequence import Sequence


class BlockManager:
    """Free list of `num_blocks` KV blocks of `block_size` tokens; a table row per sequence holding blocks.

    The rows mirror each `seq.block_table` in one int32 array [max_seqs, max_blocks_per_seq] so that a
    decode step gathers its block tables with one numpy index instead of a Python loop. Free blocks are a
    min-heap: the lowest ids are handed out first, which keeps the end of the cache free for `shrink`.
    """

    def __init__(self, num_blocks: int, block_size: int, max_seqs: int, max_blocks_per_seq: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_blocks_per_seq = max_blocks_per_seq
        self.free_blocks: list[int] = list(range(num_blocks))  # a heap
        self.used_blocks: set[int] = set()
        self.tables = np.zeros((max_seqs, max_blocks_per_seq), dtype=np.int32)
        self.free_rows: list[int] = list(range(max_seqs - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New blocks `seq` needs so that its first `num_tokens` tokens have a slot."""
        return max(0, self.blocks_for(num_tokens) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        has_row = seq.row >= 0 or bool(self.free_rows)
        return has_row and self.blocks_needed(seq, num_tokens) <= len(self.free_blocks)

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Give `seq` blocks for its first `num_tokens` tokens (the caller checked `can_allocate`)."""
        need = self.blocks_needed(seq, num_tokens)
        if need > len(self.free_blocks):
            raise RuntimeError(f"block manager: {need} blocks needed, {len(self.free_blocks)} free")
        if self.blocks_for(num_tokens) > self.max_blocks_per_seq:
            raise RuntimeError(f"block manager: {num_tokens} tokens exceed the block table width")
        if seq.row < 0:
            seq.row = self.free_rows.pop()
        start = len(seq.block_table)
        for _ in range(need):
            block = heapq.heappop(self.free_blocks)
            self.used_blocks.add(block)
            seq.block_table.append(block)
        self.tables[seq.row, start : start + need] = seq.block_table[start:]

    def free(self, seq: Sequence) -> None:
        """Return all of `seq`'s blocks and its table row."""
        for block in seq.block_table:
            self.used_blocks.remove(block)
            heapq.heappush(self.free_blocks, block)
        seq.block_table.clear()
        seq.num_computed = 0
        if seq.row >= 0:
            self.free_rows.append(seq.row)
            seq.row = -1

    def slots(self, seq: Sequence, start: int, stop: int) -> np.ndarray:
        """Cache slots (block * block_size + offset) of token positions [start, stop) of `seq`."""
        pos = np.arange(start, stop)
        blocks = self.tables[seq.row, pos // self.block_size].astype(np.int64)
        return blocks * self.block_size + pos % self.block_size

    # Hooks for a storage that grows and shrinks (the VMM page pool): blocks are added at the end and only
    # free blocks at the end can be taken away.
    def grow(self, num_blocks: int) -> None:
        for block in range(self.num_blocks, num_blocks):
            heapq.heappush(self.free_blocks, block)
        self.num_blocks = max(self.num_blocks, num_blocks)

    def shrink(self, num_blocks: int) -> bool:
        """Drop blocks >= num_blocks if none of them is in use; False (nothing changed) otherwise."""
        if any(b >= num_blocks for b in self.used_blocks):
            return False
        self.free_blocks = [b for b in self.free_blocks if b < num_blocks]
        heapq.heapify(self.free_blocks)
        self.num_blocks = min(self.num_blocks, num_blocks)
        return True

    def check(self, holders: list[Sequence]) -> None:
        """Assert the invariants: every block is free xor used by exactly one holder; tables mirror lists."""
        owned = [b for s in holders for b in s.block_table]
        assert len(owned) == len(set(owned)), "a block is owned by two sequences"
        assert set(owned) == self.used_blocks, "used blocks differ from the blocks sequences own (leak)"
        assert not (set(self.free_blocks) & self.used_blocks), "a block is both free and used"
        assert len(self.free_blocks) + len(self.used_blocks) == self.num_blocks, "blocks lost"
        assert len(set(self.free_blocks)) == len(self.free_blocks), "a block is free twice"
        rows = [s.row for s in holders if s.block_table]
        assert len(rows) == len(set(rows)) and min(rows, default=0) >= 0, "table rows shared or missing"
        for s in holders:
            assert list(self.tables[s.row, : len(s.block_table)]) == s.block_table, "table row out of date"
