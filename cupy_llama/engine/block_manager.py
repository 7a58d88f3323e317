"""Paged-KV block accounting: a free list, per-sequence block tables, reference counts.

Plain Python; the KV memory itself belongs to the backend. Block i of the backend's cache
holds tokens of whichever sequence lists i in its block table. A block table only grows
(`grow` appends) until `free` replaces it with a new empty list: the model runner keeps a
copy per running sequence and copies only the entries added since the last step.
"""
from __future__ import annotations

from collections import deque

from .sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_blocks: deque[int] = deque(range(num_blocks))
        self.ref_counts = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks seq must gain so its table covers num_tokens tokens."""
        return max(0, self.blocks_needed(num_tokens) - len(seq.block_table))

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.num_new_blocks(seq, num_tokens) <= self.num_free_blocks

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Extend seq's block table to cover num_tokens tokens."""
        needed = self.num_new_blocks(seq, num_tokens)
        if needed > self.num_free_blocks:
            raise RuntimeError(f"grow({seq.request_id}) needs {needed} blocks, "
                               f"{self.num_free_blocks} free")
        for _ in range(needed):
            block = self.free_blocks.popleft()
            self.ref_counts[block] = 1
            seq.block_table.append(block)

    def free(self, seq: Sequence) -> None:
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_blocks.append(block)
        seq.block_table = []  # a new list, never cleared in place (see the module docstring)
        seq.num_computed_tokens = 0

    def check_invariants(self, live: list[Sequence]) -> None:
        """Every block is free xor referenced exactly as often as tables list it."""
        counts = [0] * self.num_blocks
        for seq in live:
            for block in seq.block_table:
                counts[block] += 1
        free = set(self.free_blocks)
        assert len(free) == len(self.free_blocks), "a block is on the free list twice"
        for block in range(self.num_blocks):
            assert counts[block] == self.ref_counts[block], f"block {block}: refcount mismatch"
            assert (block in free) == (counts[block] == 0), f"block {block}: free/used mismatch"
