"""Block allocation for the paged KV pool: reference-counted blocks, a block
table per sequence, all blocks free again once every sequence let go. Free blocks are handed out
lowest id first, so a sequence's blocks tend to be one run of consecutive
ids (transports move a run as one piece) even after much churn.
Thread-safe: a transport's receiver thread reserves blocks for KV that is
arriving while the engine thread schedules (which holds ``lock`` for a
whole step's planning)."""
from __future__ import annotations

import heapq
import threading


class OutOfBlocks(MemoryError):
    pass


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.refs = [0] * num_blocks
        self.free = list(range(num_blocks))  # a heap
        self.lock = threading.RLock()

    @property
    def num_free(self) -> int:
        return len(self.free)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def can_grow(self, table: list[int], tokens: int) -> bool:
        return self.blocks_for(tokens) - len(table) <= len(self.free)

    def grow(self, table: list[int], tokens: int) -> None:
        """Append blocks to ``table`` until it holds ``tokens`` tokens."""
        with self.lock:
            need = self.blocks_for(tokens) - len(table)
            if need > len(self.free):
                raise OutOfBlocks(f"{need} blocks needed, {len(self.free)} free")
            for _ in range(need):
                block = heapq.heappop(self.free)
                self.refs[block] = 1
                table.append(block)

    def share(self, table: list[int]) -> list[int]:
        with self.lock:
            for block in table:
                self.refs[block] += 1
            return list(table)

    def release(self, table: list[int]) -> None:
        with self.lock:
            for block in table:
                self.refs[block] -= 1
                if self.refs[block] == 0:
                    heapq.heappush(self.free, block)
                elif self.refs[block] < 0:
                    raise RuntimeError(f"block {block} released more often than taken")
            table.clear()
