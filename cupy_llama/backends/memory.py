"""What a backend holds in memory, as `cupy-llama info` shows it and the backend sizes it."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MemoryPlan:
    rows: tuple[tuple[str, int, str], ...]  # (what, bytes, note), one per allocation
    num_kv_blocks: int
    block_size: int

    @property
    def num_kv_tokens(self) -> int:
        return self.num_kv_blocks * self.block_size
