"""Paged-KV block accounting: free blocks, per-sequence block tables, reference counts, and
the prefix cache.

Plain Python; the KV memory itself belongs to the backend. Block i of the backend's cache
holds tokens of whichever sequences list i in their block tables. A block table only grows
(`allocate` and `grow` append) until `free` replaces it with a new empty list: the model
runner keeps a copy per running sequence and copies only the entries added since the last
step.

Prefix caching (docs/ARCHITECTURE.md, "Prefix caching"). Every FULL block whose tokens are
all known and whose K/V are computed gets a hash of (its parent block's hash, its token
ids), kept in a map from hash to block. A new sequence takes its longest run of cached
full blocks and holds a reference on each, so its prefill starts at its first uncached
token. Shared blocks are full and never written again; a sequence's partly filled last
block is always its own. A block no sequence holds keeps its contents and stays in the map,
in least-recently-used order; it is handed out again (and leaves the map) only when no
block that caches nothing is free.

No synchronisation is needed: a block enters the map after the step that computes it is
launched, only a later step can read it, and the device runs steps in launch order on one
stream. A block freed while a step that writes or reads it still runs is likewise only
written again by a later step.
"""
from __future__ import annotations

import functools
import hashlib
import struct
from collections import OrderedDict, deque

from ..util import cdiv
from .sequence import Sequence, SequenceStatus

# The hash of a block is SHA-256 over its parent block's digest and its token ids (int32,
# little-endian: the same on every machine). A cache keyed on content must never confuse
# two contents: a wrong hit gives a silently wrong answer, and a server's users could craft
# one on purpose against a weak hash. Python's hash() of a tuple is 64 bits and not
# collision-resistant (an int hashes to itself modulo 2^61 - 1), so it is not used. SHA-256
# costs about 0.6 us per 16-token block, once per block: some 17,000 blocks, about 10 ms,
# over the standard offline workload.
ROOT_HASH = hashlib.sha256(b"cupy-llama prefix cache").digest()  # the first block's parent


def block_hash(parent: bytes, token_ids: list[int]) -> bytes:
    return hashlib.sha256(parent + _int32s(len(token_ids)).pack(*token_ids)).digest()


@functools.lru_cache(maxsize=None)
def _int32s(count: int) -> struct.Struct:
    return struct.Struct(f"<{count}i")


class ReusableBlocks:
    """What a sequence can take instead of computing it (BlockManager.reusable_blocks):
    the scheduler reads only how many tokens that covers and hands it back to allocate()."""
    __slots__ = ("blocks", "num_hits", "num_tokens")

    def __init__(self, blocks: list[int], num_hits: int, block_size: int):
        self.blocks = blocks        # full blocks, from the first
        self.num_hits = num_hits    # how many of them the prefix cache gave
        self.num_tokens = len(blocks) * block_size


class _Hashes:
    """A sequence's content hashes (the block manager's own record, Sequence.kv_hashes): the
    digests of its leading full blocks of known tokens, worked out once each (tokens never
    change once known), and how many leading blocks of its table are settled in the cache
    (found there at admission, or offered to it once computed; a block whose content
    another block already holds stays private)."""
    __slots__ = ("digests", "num_settled")

    def __init__(self):
        self.digests: list[bytes] = []
        self.num_settled = 0


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.ref_counts = [0] * num_blocks
        # free blocks the cache does not hold: never used, or holding nothing reusable
        self.free_blocks: deque[int] = deque(range(num_blocks))
        # free blocks the cache holds, least recently used first (the order they are evicted)
        self.cached_free: OrderedDict[int, None] = OrderedDict()
        self.cached: dict[bytes, int] = {}                 # hash -> block
        self.hash_of: list[bytes | None] = [None] * num_blocks  # block -> its hash in `cached`
        # prompt tokens looked up in the cache at each sequence's first admission, and the
        # ones found there (the hit rate is their ratio); counted with caching on only
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds, whether the cache holds them or not."""
        return len(self.free_blocks) + len(self.cached_free)

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def num_new_blocks(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks seq must gain so its table covers num_tokens tokens."""
        needed = -(-num_tokens // self.block_size) - len(seq.block_table)  # runs every step
        return needed if needed > 0 else 0

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.num_new_blocks(seq, num_tokens) <= self.num_free_blocks

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Extend seq's block table to cover num_tokens tokens with fresh blocks."""
        needed = self.num_new_blocks(seq, num_tokens)
        if needed > self.num_free_blocks:
            raise RuntimeError(f"grow({seq.request_id}) needs {needed} blocks, "
                               f"{self.num_free_blocks} free")
        for _ in range(needed):
            block = self._take_free_block()
            self.ref_counts[block] = 1
            seq.block_table.append(block)

    def _take_free_block(self) -> int:
        """A block that caches nothing if there is one, else the least recently used cached
        one, which leaves the cache."""
        if self.free_blocks:
            return self.free_blocks.popleft()
        block, _ = self.cached_free.popitem(last=False)
        del self.cached[self.hash_of[block]]
        self.hash_of[block] = None
        return block

    # ---- admission: reused blocks first, then fresh ones ----------------------------------
    def reusable_blocks(self, seq: Sequence) -> ReusableBlocks:
        """The full blocks seq can take instead of computing them: its longest run of
        cached blocks (none with caching off), then, for a sample 1..n-1, the rest of its
        parent's computed full prompt blocks while the parent holds them (a block's K/V
        depend only on the tokens up to its end, the same for both). Nothing is taken yet:
        `allocate` does."""
        reused = []
        # a prompt whose log-probabilities are asked is computed whole: they need the
        # hidden state at every position, which a cached block does not keep
        if self.enable_caching and seq.params.prompt_logprobs is None:
            for digest in self.hashes(seq):
                block = self.cached.get(digest)
                if block is None:
                    break
                reused.append(block)
        num_hits = len(reused)
        parent = seq.parent
        if parent is not None and parent.status is SequenceStatus.RUNNING:
            computed = min(seq.num_prompt_tokens, parent.num_computed_tokens)
            shared = computed // self.block_size
            if shared > num_hits:
                reused = reused + parent.block_table[num_hits:shared]
        return ReusableBlocks(reused, num_hits, self.block_size)

    def hashes(self, seq: Sequence, num_blocks: int | None = None) -> list[bytes]:
        """seq's block digests extended over its first num_blocks full blocks (default: all
        of them), as far as their tokens are known. The new blocks' tokens are packed in
        one go: a 2,048-token prompt is 128 blocks to hash when it arrives."""
        if seq.kv_hashes is None:
            seq.kv_hashes = _Hashes()
        bs, hashes = self.block_size, seq.kv_hashes.digests
        first, end = len(hashes), seq.num_tokens // bs if num_blocks is None else num_blocks
        if first >= end:
            return hashes
        token_ids = seq.token_slice(first * bs, end * bs)
        if min(token_ids) < 0:  # tokens still coming (placeholders): hash up to the first
            known = next(i for i, token in enumerate(token_ids) if token < 0)
            end = first + known // bs
            token_ids = token_ids[:(end - first) * bs]
        data = struct.pack(f"<{len(token_ids)}i", *token_ids)  # as block_hash packs them
        parent, width = hashes[-1] if hashes else ROOT_HASH, 4 * bs
        for start in range(0, len(data), width):
            parent = hashlib.sha256(parent + data[start:start + width]).digest()
            hashes.append(parent)
        return hashes

    def can_allocate(self, reused: ReusableBlocks, num_tokens: int) -> bool:
        """Whether a sequence taking the blocks `reused` can cover num_tokens tokens: fresh
        blocks for the rest, and each reused block no one holds counts as taken from the
        free ones too."""
        fresh = max(0, self.blocks_needed(num_tokens) - len(reused.blocks))
        revived = sum(1 for block in reused.blocks if self.ref_counts[block] == 0)
        return fresh + revived <= self.num_free_blocks

    def allocate(self, seq: Sequence, reused: ReusableBlocks, num_tokens: int) -> None:
        """Give seq (holding no blocks) a table of the blocks `reused` (a reference each),
        then fresh blocks up to num_tokens tokens. The reused blocks are taken first, so
        the fresh ones never evict them. At a sequence's first admission this counts the
        prompt tokens looked up and those the cache held (seq.num_cached_tokens)."""
        assert not seq.block_table, "allocate is for a sequence that holds no blocks"
        for block in reused.blocks:
            if self.ref_counts[block] == 0:
                del self.cached_free[block]
            self.ref_counts[block] += 1
            seq.block_table.append(block)
        if seq.kv_hashes is None:
            seq.kv_hashes = _Hashes()
        seq.kv_hashes.num_settled = len(reused.blocks)
        # tokens at the head of the table this sequence took rather than computed: shared,
        # full blocks that it never writes (the model runner gives them KV slot -1)
        seq.num_reused_tokens = reused.num_tokens
        if seq.num_cached_tokens < 0:  # the first admission: what the cache gave
            seq.num_cached_tokens = min(reused.num_hits * self.block_size, seq.num_prompt_tokens)
            if self.enable_caching:
                self.num_queried_tokens += seq.num_prompt_tokens
                self.num_hit_tokens += seq.num_cached_tokens
        self.grow(seq, num_tokens)

    # ---- the cache fills as blocks are computed -------------------------------------------
    def on_computed(self, seqs: list[Sequence]) -> None:
        """A step has computed these sequences' new tokens: a block that filled goes to the
        cache once its tokens are known as well (a decode step's input token is a
        placeholder until the step after, ForwardBatch)."""
        if not self.enable_caching:
            return
        block_size, cached = self.block_size, self.cached
        for seq in seqs:
            record = seq.kv_hashes
            settled = record.num_settled if record is not None else 0
            end = (settled + 1) * block_size
            computed = seq.num_computed_tokens
            if computed < end or seq.token_id(end - 1) < 0:
                continue  # no block filled, or its last token still coming
            first = end - block_size - seq.num_prompt_tokens  # its first output token
            one_output_block = (computed < end + block_size  # one block filled, not more
                                and first >= 0               # of output tokens only
                                and len(record.digests) == settled)  # the rest settled
            if not one_output_block:
                self.cache_computed_blocks(seq)  # the general walk
                continue
            # a decode step's usual case: its tokens are known (placeholders are only ever
            # the last tokens, and its last one is known)
            digest = block_hash(record.digests[-1] if settled else ROOT_HASH,
                                seq.output_token_ids[first:first + block_size])
            record.digests.append(digest)
            if digest not in cached:  # else another block holds it: this one stays private
                block = seq.block_table[settled]
                cached[digest] = block
                self.hash_of[block] = digest
            record.num_settled = settled + 1

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Offer the cache every full block of seq whose K/V are computed and whose tokens are
        all known, from the first not offered yet. Called when a step may have filled a
        block and when a sequence lets its blocks go."""
        if not self.enable_caching:
            return
        num_full = min(seq.num_computed_tokens, seq.num_tokens) // self.block_size
        if seq.kv_hashes is not None and seq.kv_hashes.num_settled >= num_full:
            return
        # hashed as far as the tokens are known (a token still coming: its block waits);
        # the blocks before the first offered may need hashes too, if the sequence took
        # them from its parent with caching off
        hashes = self.hashes(seq, num_full)
        record = seq.kv_hashes
        for i in range(record.num_settled, min(num_full, len(hashes))):
            digest = hashes[i]
            if digest not in self.cached:  # else another block holds it: this one stays private
                block = seq.block_table[i]
                assert self.hash_of[block] is None
                self.cached[digest] = block
                self.hash_of[block] = digest
            record.num_settled = i + 1

    def free(self, seq: Sequence) -> None:
        """Let go of seq's blocks. What it computed stays findable first: a preempted
        sequence finds it again when it is recomputed, a chat's next turn its reply."""
        self.cache_computed_blocks(seq)
        # last block first, so a sequence's later blocks are evicted before its earlier ones
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                if self.hash_of[block] is None:
                    self.free_blocks.append(block)
                else:
                    self.cached_free[block] = None  # the most recently used end
        seq.block_table = []  # a new list, never cleared in place (see the module docstring)
        seq.num_computed_tokens = 0
        if seq.kv_hashes is not None:
            seq.kv_hashes.num_settled = 0
        seq.num_reused_tokens = 0

    def reset_prefix_cache(self) -> None:
        """Forget every cached block: the free ones cache nothing any more, and blocks still
        held are not cached when they are freed. Safe at any time."""
        self.free_blocks.extend(self.cached_free)
        self.cached_free.clear()
        for block in self.cached.values():
            self.hash_of[block] = None
        self.cached.clear()

    def check_invariants(self, live: list[Sequence]) -> None:
        """Every block is held exactly as often as tables list it, or else free: cached or
        not, never both; the map and the blocks agree on each hash."""
        counts = [0] * self.num_blocks
        for seq in live:
            assert len(set(seq.block_table)) == len(seq.block_table), f"{seq}: a block twice"
            for block in seq.block_table:
                counts[block] += 1
        free, cached_free = set(self.free_blocks), set(self.cached_free)
        assert len(free) == len(self.free_blocks), "a block is on the free list twice"
        assert not free & cached_free, "a block is free both as cached and as not"
        for block in range(self.num_blocks):
            assert counts[block] == self.ref_counts[block], f"block {block}: refcount mismatch"
            assert (block in free or block in cached_free) == (counts[block] == 0), \
                f"block {block}: free/used mismatch"
            digest = self.hash_of[block]
            if block in cached_free:
                assert digest is not None, f"block {block}: cached free but not in the map"
            if block in free:
                assert digest is None, f"block {block}: in the map but on the plain free list"
            if digest is not None:
                assert self.cached.get(digest) == block, f"block {block}: the map disagrees"
        assert len(self.cached) == sum(1 for d in self.hash_of if d is not None)
