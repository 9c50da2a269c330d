"""Block allocation for the paged KV pool: reference-counted blocks, a block
table per sequence, all blocks free again once every sequence let go. Free blocks are handed out
lowest id first, and the blocks one ``grow`` takes go into the table in
ascending order, so a sequence's blocks tend to be a few runs of consecutive
ids (transports move a run as one piece) even after much churn: once the
prefix cache holds the whole pool, the blocks evicted for a new sequence are
mostly those an earlier sequence let go together, and sorted they are its
runs again (taken one by one in eviction order they came out last first, a
piece per block: KV of 7k tokens in 440 pieces, whose gather and scatter held
the GIL for tens of milliseconds a transfer).

Prefix cache (``caching``): a full block registered under its chained hash
(``prefix_hash``) stays cached when its last user lets go, and is handed out
again to a sequence whose prompt starts with the same tokens (``match`` +
``take``). Cached blocks nobody uses count as free; when no truly free block
is left the least recently used one is evicted, and of one sequence's blocks
the last first (its head stays matchable longest). ``drain_events`` returns the
keys stored and evicted since the last call (workers report them to routers).
A tier below (``lower``, e.g. ``kvcache.HostTier``) is offered the blocks one
``grow`` evicts (``lower.offload_many(pairs)``) before they are handed out
again; a key it keeps is reported demoted (``drain_demoted``), not evicted until
the tier drops it too (``dropped_below``); it is told when a cached block it may hold a copy of is
handed out again (``lower.taken(key)``).
Thread-safe: a transport's receiver thread reserves blocks for KV that is
arriving while the engine thread schedules (which holds ``lock`` for a
whole step's planning)."""
from __future__ import annotations

import heapq
import threading
from collections import OrderedDict


class OutOfBlocks(MemoryError):
    pass


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, caching: bool = False):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.caching = caching
        self.refs = [0] * num_blocks
        self.free = list(range(num_blocks))  # a heap
        self.key_of: list[int | None] = [None] * num_blocks
        self.by_key: dict[int, int] = {}
        self.idle: OrderedDict[int, None] = OrderedDict()  # cached blocks with no user, oldest first
        self.stored: set[int] = set()
        self.evicted: set[int] = set()
        self.demoted: set[int] = set()  # evicted from the pool but kept by the tier below, since the last drain
        self.sunk: set[int] = set()  # of the keys held below the pool, those passed down to the lowest tier (disk)
        self.changes = 0  # grows whenever the free or idle blocks change (a tier's write-ahead looks again then)
        self.lower = None  # a tier below the pool (kvcache), offered what the pool evicts
        self.remote = None  # a cluster-wide pool (kvcache.pool), offered every block registered, matched last
        self.lock = threading.RLock()

    @property
    def num_free(self) -> int:
        return len(self.free) + len(self.idle)

    @property
    def num_cached(self) -> int:
        return len(self.by_key)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def can_grow(self, table: list[int], tokens: int) -> bool:
        return self.blocks_for(tokens) - len(table) <= self.num_free

    def _pop_free(self, evicting: list) -> int:
        self.changes += 1
        if self.free:
            return heapq.heappop(self.free)
        block, _ = self.idle.popitem(last=False)
        key = self.key_of[block]
        self.key_of[block] = None
        del self.by_key[key]
        self.stored.discard(key)
        evicting.append((key, block))
        return block

    def _evict(self, evicting: list) -> None:
        """The cached blocks just taken back: offered to the tier below in one batch; what it does not keep is
        evicted from this worker."""
        kept = self.lower.offload_many(evicting) if self.lower is not None and evicting else set()
        self.evicted.update(key for key, _ in evicting if key not in kept)
        self.demoted.update(kept)

    def grow(self, table: list[int], tokens: int) -> None:
        """Append blocks to ``table`` until it holds ``tokens`` tokens."""
        with self.lock:
            need = self.blocks_for(tokens) - len(table)
            if need > self.num_free:
                raise OutOfBlocks(f"{need} blocks needed, {self.num_free} free")
            evicting = []
            taken = sorted(self._pop_free(evicting) for _ in range(need))
            self._evict(evicting)
            for block in taken:
                self.refs[block] = 1
            table.extend(taken)

    def share(self, table: list[int]) -> list[int]:
        with self.lock:
            for block in table:
                self._ref(block)
            return list(table)

    def _ref(self, block: int) -> None:
        if self.refs[block] == 0:
            self.idle.pop(block, None)
            self.changes += 1
            key = self.key_of[block]
            if key is not None and self.lower is not None:
                self.lower.taken(key)
        self.refs[block] += 1

    def release(self, table: list[int]) -> None:
        """Let go of ``table``'s blocks, last first: of one sequence's cached blocks the tail becomes evictable
        before the head (a prefix is matched from its first block: an evicted head would strand the rest)."""
        with self.lock:
            self.changes += 1
            for block in reversed(table):
                self.refs[block] -= 1
                if self.refs[block] == 0:
                    if self.key_of[block] is not None:
                        self.idle[block] = None
                    else:
                        heapq.heappush(self.free, block)
                elif self.refs[block] < 0:
                    raise RuntimeError(f"block {block} released more often than taken")
            table.clear()

    def match(self, keys: list[int]) -> list[int]:
        """Blocks holding the longest cached prefix of ``keys`` (not taken: see ``take``)."""
        if not self.caching:
            return []
        out = []
        with self.lock:
            for key in keys:
                block = self.by_key.get(key)
                if block is None:
                    break
                out.append(block)
        return out

    def take(self, blocks: list[int]) -> list[int]:
        """One more user of each cached block (they stop being evictable); a new table of them."""
        with self.lock:
            for block in blocks:
                self._ref(block)
            return list(blocks)

    def register(self, block: int, key: int) -> None:
        """``block`` now holds the full block keyed ``key`` (a block or key already registered stays as it is)."""
        if not self.caching:
            return
        with self.lock:
            if self.key_of[block] is None and key not in self.by_key:
                self.key_of[block] = key
                self.by_key[key] = block
                self.evicted.discard(key)
                self.demoted.discard(key)
                self.sunk.discard(key)
                self.stored.add(key)
                if self.remote is not None:
                    self.remote.publish(key, block)

    def dropped_below(self, key: int) -> None:
        """The tier below dropped ``key``: evicted from this worker, unless the pool holds it again."""
        with self.lock:
            if key not in self.by_key:
                self.stored.discard(key)
                self.demoted.discard(key)
                self.sunk.discard(key)
                self.evicted.add(key)

    def sunk_below(self, key: int) -> None:
        """A tier passed ``key`` down to the one under it (host memory to disk): held still, at a disk's cost."""
        with self.lock:
            if key not in self.by_key:
                self.sunk.add(key)

    def keys(self) -> list[int]:
        with self.lock:
            return list(self.by_key)

    def lower_keys(self) -> list[int]:
        """Keys held only by the tiers below the pool."""
        with self.lock:
            return [k for k in self.lower.keys() if k not in self.by_key] if self.lower is not None else []

    def drain_demoted(self) -> tuple[list[int], list[int]]:
        """Keys the pool evicted into the tier below, and keys passed down to the lowest tier (disk), since the last
        call (and not stored again or dropped since): held by this worker still, at a tier's cost (``drain_events``
        holds what was stored and evicted)."""
        with self.lock:
            demoted, sunk, self.demoted, self.sunk = sorted(self.demoted), sorted(self.sunk), set(), set()
            return demoted, sunk

    def disk_keys(self) -> list[int]:
        """Of ``lower_keys``, those held only on disk (the tier under the host tier)."""
        with self.lock:
            disk = getattr(self.lower, "lower", None) if self.lower is not None else None
            if disk is None:
                return []
            return [k for k in disk.keys() if k not in self.by_key and k not in self.lower.slot_of]

    def drain_pooled(self) -> list[int]:
        """Keys put in the cluster-wide pool since the last call (held there for every worker, until the store
        drops them)."""
        return self.remote.drain_published() if self.remote is not None else []

    def pooled_keys(self) -> list[int]:
        return self.remote.keys() if self.remote is not None else []

    def drain_events(self) -> tuple[list[int], list[int]]:
        """Keys stored and keys evicted since the last call (disjoint: the later event of a key wins)."""
        with self.lock:
            stored, evicted = sorted(self.stored), sorted(self.evicted)
            self.stored, self.evicted = set(), set()
            return stored, evicted
