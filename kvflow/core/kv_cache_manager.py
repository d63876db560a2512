"""Block tables, and the prefix cache on top of them.

Every full block gets a content hash chained from its parent's: sha256(parent hash, token ids,
extra key). Equal hashes mean equal KV (same model, same tokens at the same positions), so a new
request can share the blocks of its longest cached prefix and prefill only the rest.

With KV events on (`events`), every run of blocks entered in the cache is reported as one
`BlockStored` (hashes, parent hash, token ids), evictions by the pool as `BlockRemoved`.

Sliding windows (`layout`, kvflow.core.kv_groups): a request has one block table per KV group.
A window group's table keeps only the blocks the next query can read; the ones before point at
NULL_BLOCK, theirs released to the pool as soon as a step starts past them (`_drop_out_of_window`,
the one place blocks leave a running request early: any later policy that drops old blocks, such
as attention sinks, belongs next to it). Each group enters its blocks in the prefix cache under
its own key (the block hash, plus the group's index for groups past 0), and a prefix hit counts
only as far as every window group still holds the blocks its window reaches back to from the hit
(`get_computed_blocks`): otherwise the hit is shorter. Only group 0's hashes are reported as KV
events (the router's prefix view speaks of plain hashes).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvflow.core.block_hash import hash_block
from kvflow.core.block_pool import BlockPool
from kvflow.core.kv_groups import NULL_BLOCK, KVLayout
from kvflow.core.request import Request

if TYPE_CHECKING:
    from kvflow.kv_events.events import KVEventSink


@dataclass
class ComputedBlocks:
    """A request's cached prefix: blocks already in the pool, then blocks a KV connector supplies
    (an offload tier, another engine) into fresh blocks. With a hybrid layout, `group_blocks`
    holds every KV group's hits (group 0's are `blocks`), NULL_BLOCK where a window group needs
    no block any more."""

    blocks: list[int] = field(default_factory=list)
    num_external_blocks: int = 0
    group_blocks: list[list[int]] = field(default_factory=list)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks) + self.num_external_blocks


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of which found in the cache

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        extra_key: bytes = b"",
        events: KVEventSink | None = None,
        layout: KVLayout | None = None,
    ) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching)
        self.events = events  # KV events (None: off); the offload tiers report into it too
        self.pool.events = events
        self.enable_caching = enable_caching
        self.extra_key = extra_key  # e.g. the model identity, so hashes never match across models
        self.layout = layout
        # Per KV group its window (None: full attention); no layout: one group keeping everything.
        self.windows: list[int | None] = [g.window for g in layout.groups] if layout is not None else [None]
        # The block freed table entries point at (reserved, never written), or None: nothing freed early.
        self.null_block: int | None = None
        if any(w is not None for w in self.windows):
            self.pool.reserve(NULL_BLOCK)
            self.null_block = NULL_BLOCK
        # request id (or a held transfer's key) -> one block table per KV group
        self.tables: dict[str, list[list[int]]] = {}
        self._dropped: dict[str, list[int]] = {}  # per request and group: entries before this are NULL
        self.num_cached_blocks: dict[str, int] = {}  # per request: leading blocks registered in the cache
        # per request: tokens whose blocks were dropped from its table after its sink blocks
        # (attention sinks, kvflow.core.attention_sinks); its cache holds computed - these
        self.num_dropped_tokens: dict[str, int] = {}
        self.prefix_stats = PrefixCacheStats()

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def block_tables(self) -> dict[str, list[int]]:
        """Group 0's table of every request (all of it without a hybrid layout)."""
        return {rid: t[0] for rid, t in self.tables.items()}

    def _first_needed(self, group: int, first_query: int) -> int:
        """The first block of `group` a query at position first_query (or later) can read."""
        w = self.windows[group]
        return 0 if w is None else max(0, first_query - w + 1) // self.block_size

    def _key(self, block_hash: bytes, group: int) -> bytes:
        # One pool, one hash map: each group's copy of a block's KV is cached under its own key.
        return block_hash if group == 0 else block_hash + group.to_bytes(2, "little")

    # ---- prefix cache ----------------------------------------------------------------------
    def _update_hashes(self, req: Request, num_tokens: int) -> None:
        """Extend req.block_hashes to cover every full block among its first num_tokens tokens."""
        bs = self.block_size
        hashes = req.block_hashes
        for i in range(len(hashes), num_tokens // bs):
            hashes.append(
                hash_block(
                    hashes[-1] if hashes else None,
                    req.token_ids_between(i * bs, (i + 1) * bs),
                    self.extra_key + req.cache_key,  # (+ the request's LoRA adapter)
                )
            )

    def get_computed_blocks(self, req: Request) -> ComputedBlocks:
        """req's longest cached prefix in the pool (nothing is referenced yet; see allocate_slots).
        At least one token is always left to compute so there are logits to sample from. Also
        brings req.block_hashes up to date, for the KV connector's lookup after this one."""
        found = ComputedBlocks()
        if not self.enable_caching:
            return found
        self._update_hashes(req, req.num_tokens)
        hashes = req.block_hashes[: (req.num_tokens - 1) // self.block_size]
        if self.num_groups == 1 and self.windows[0] is None:
            found.blocks = self.pool.lookup(hashes)
            return found
        # Per group, the cached block of each hash (None: missing). A full-attention group needs
        # every block before the hit; a window group those its window reaches from the hit on.
        cached = self.pool.cached
        ids = [[cached.get(self._key(h, g)) for h in hashes] for g in range(self.num_groups)]
        hit = len(hashes)
        for g, w in enumerate(self.windows):
            if w is None:
                hit = min(hit, next((i for i, b in enumerate(ids[g]) if b is None), hit))
        runs = []  # per window group: length of the run of cached blocks ending at each index
        for g, w in enumerate(self.windows):
            if w is not None:
                run, n = [], 0
                for b in ids[g][:hit]:
                    n = n + 1 if b is not None else 0
                    run.append(n)
                runs.append((g, run))
        while hit > 0 and not all(
            run[hit - 1] >= hit - self._first_needed(g, hit * self.block_size) for g, run in runs
        ):
            hit -= 1
        found.group_blocks = [
            [b if i >= self._first_needed(g, hit * self.block_size) else NULL_BLOCK for i, b in enumerate(ids[g][:hit])]
            for g in range(self.num_groups)
        ]
        found.blocks = found.group_blocks[0]
        return found

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        if self.enable_caching:
            self.prefix_stats.queries += num_tokens
            self.prefix_stats.hits += num_hit_tokens

    # ---- allocation ------------------------------------------------------------------------
    def allocate_slots(
        self, req: Request, num_new_tokens: int, computed: ComputedBlocks | None = None, register: bool = True
    ) -> bool:
        """Make room for num_new_tokens more tokens of req, after the cached prefix it reuses
        (`computed`, for a request being admitted: its external blocks are the first new ones).
        Returns False if the pool is short, changing nothing but releasing the blocks that have
        left a window (never needed again). `register=False`: do not enter the new full blocks in
        the prefix cache yet (their KV arrives asynchronously)."""
        computed = computed or ComputedBlocks()
        rid = req.request_id
        bs = self.block_size
        tables = self.tables.get(rid) or [[] for _ in self.windows]
        # (no group_blocks: a single group's hits, or no hit at all)
        hits = computed.group_blocks or [computed.blocks] + [[] for _ in self.windows[1:]]
        num_computed = req.num_computed_tokens - self.dropped_tokens(req) + computed.num_blocks * bs
        total = num_computed + num_new_tokens
        end = cdiv(total, bs)
        if rid in self.tables and self.null_block is not None:
            self._drop_out_of_window(rid, num_computed)
        needed = revived = 0
        for g in range(self.num_groups):
            have = len(tables[g]) + len(hits[g])
            needed += max(0, end - max(have, self._first_needed(g, num_computed)))
            # Reviving cached-free blocks takes them out of the free queue too.
            revived += sum(1 for b in hits[g] if b != self.null_block and self.pool.ref_counts[b] == 0)
        if needed + revived > self.pool.num_free_blocks:
            return False
        self.tables.setdefault(rid, tables)
        dropped = self._dropped.setdefault(rid, [0] * self.num_groups)
        for g, table in enumerate(tables):
            self.pool.touch([b for b in hits[g] if b != self.null_block])
            table.extend(hits[g])
            first = self._first_needed(g, num_computed)
            if len(table) < first:  # never allocated: out of the window already
                table.extend([NULL_BLOCK] * (first - len(table)))
            dropped[g] = max(dropped[g], first)
            if end > len(table):
                table.extend(self.pool.allocate(end - len(table)))
        if self.enable_caching and register:
            # Blocks that will be full of the sequence's own tokens once this step has run (loaded
            # ones included). Registering them now is safe: the runner loads before the forward
            # pass, and within the pass every layer writes all new K/V before any attention reads
            # it. Draft tokens (speculative decoding) lie past num_tokens: a block holding any is
            # registered only once verification has made its tokens the sequence's.
            full = min(total, req.num_tokens) // bs
            self._update_hashes(req, full * bs)
            start = max(self.num_cached_blocks.get(rid, 0), len(computed.blocks))
            for g, table in enumerate(tables):
                self._cache_blocks(req, g, table, start, full)
            self.num_cached_blocks[rid] = max(start, full)
        return True

    def _drop_out_of_window(self, rid: str, first_query: int) -> None:
        """Release the blocks of rid's window groups that no query from first_query on can read;
        their entries point at NULL_BLOCK. They stay in the prefix cache as cached-free blocks."""
        tables, dropped = self.tables[rid], self._dropped[rid]
        for g, table in enumerate(tables):
            first = min(self._first_needed(g, first_query), len(table))
            if first <= dropped[g]:
                continue
            gone = [b for b in table[dropped[g] : first] if b != self.null_block]
            table[dropped[g] : first] = [NULL_BLOCK] * (first - dropped[g])
            dropped[g] = first
            self.pool.release(gone)

    # Attention sinks (kvflow.core.attention_sinks) drop a request's old blocks here too: a request's
    # tables are self.tables[request_id], one list per KV group; group 0's is the only one without a
    # hybrid layout (sinks refuse windowed models, so theirs is always one full-attention group).
    # Entries equal to self.null_block (None when nothing is freed early) hold no block.

    def _cache_blocks(self, req: Request, group: int, table: list[int], start: int, end: int) -> None:
        """Enter blocks [start, end) of req's table of `group` in the prefix cache (their hashes
        are computed). NULL entries (out of a window) are skipped."""
        null = self.null_block
        if self.events is None or group != 0:
            for i in range(start, end):
                if table[i] != null:
                    self.pool.cache_block(table[i], self._key(req.block_hashes[i], group))
            return
        run = start  # the first block of the current run of newly cached blocks
        for i in range(start, end + 1):
            if i < end and table[i] != null and self.pool.cache_block(table[i], req.block_hashes[i]):
                continue
            if i > run:  # blocks [run, i) entered the cache: one event, a chain
                bs = self.block_size
                self.events.stored(
                    req.block_hashes[run:i],
                    req.block_hashes[run - 1] if run > 0 else None,
                    req.token_ids_between(run * bs, i * bs),
                    bs,
                )
            run = i + 1

    def register_loaded(self, req: Request) -> None:
        """Enter req's full blocks in the prefix cache once their asynchronously loaded KV is in
        (KV connectors: one group of full attention only, see `kv_connector_refusal`)."""
        table = self.tables.get(req.request_id, [[]])[0]
        full = min(len(table), req.num_tokens // self.block_size)
        self._update_hashes(req, full * self.block_size)
        self._cache_blocks(req, 0, table, 0, full)

    def hold(self, req: Request, key: str) -> None:
        """Keep a finished request's blocks under `key` (for a KV transfer); see release_held."""
        self.num_cached_blocks.pop(req.request_id, None)
        self._dropped.pop(req.request_id, None)
        tables = self.tables.pop(req.request_id, None)
        if tables:
            self.tables[key] = tables

    def release_held(self, key: str) -> None:
        self._release(self.tables.pop(key, None))

    def dropped_tokens(self, req: Request) -> int:
        """Tokens of req no longer in its cache (see drop_blocks): its cache position = index - this."""
        return self.num_dropped_tokens.get(req.request_id, 0)

    def drop_blocks(self, req: Request, start: int, count: int) -> list[int]:
        """Attention sinks: drop blocks [start, start + count) of req's table (one group of full
        attention; never in the prefix cache). Returns the blocks after them, now `count` lower."""
        if self.num_groups != 1 or self.windows[0] is not None:
            raise RuntimeError("drop_blocks: attention sinks need one KV group of full attention")
        if self.num_cached_blocks.get(req.request_id, 0) > start:
            raise RuntimeError("drop_blocks: blocks entered in the prefix cache cannot be dropped")
        table = self.tables[req.request_id][0]
        self.pool.release(table[start : start + count])
        del table[start : start + count]
        self.num_dropped_tokens[req.request_id] = self.dropped_tokens(req) + count * self.block_size
        return table[start:]

    def free(self, req: Request) -> None:
        self.num_dropped_tokens.pop(req.request_id, None)
        self.num_cached_blocks.pop(req.request_id, None)
        self._dropped.pop(req.request_id, None)
        self._release(self.tables.pop(req.request_id, None))

    def _release(self, tables: list[list[int]] | None) -> None:
        for table in tables or ():
            self.pool.release([b for b in table if b != self.null_block])

    def block_table(self, req: Request) -> list[int]:
        return self.tables[req.request_id][0]

    def group_block_tables(self, req: Request) -> list[list[int]]:
        """req's tables of groups 1.. (empty without a hybrid layout)."""
        return self.tables[req.request_id][1:]

    def num_held_blocks(self, request_id: str) -> int:
        """Blocks a request holds, over every group."""
        return sum(sum(b != self.null_block for b in t) for t in self.tables.get(request_id, ()))

    def empty_slots(self, req: Request) -> int:
        """Slots allocated to req but not (yet) holding its KV: only each table's last block can
        be partly empty, and such a block is never shared."""
        in_cache = req.num_computed_tokens - self.dropped_tokens(req)
        return sum(len(t) * self.block_size - in_cache for t in self.tables.get(req.request_id, ()) if t)

    @property
    def usage(self) -> float:
        return self.pool.usage()

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks
