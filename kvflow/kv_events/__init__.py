"""KV cache events, as vLLM publishes them (`--kv-events-config`): which blocks an engine's prefix
cache holds, in which medium, as it changes.

- `events`: the event types (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`, `KVEventBatch`)
  and `KVEventSink`, where the KV cache manager, the block pool and the offload tiers put them.
  No sockets, no third-party imports: `kvflow.core` and `kvflow.kv_transfer` import it.
- `codec`: the wire form, vLLM's msgpack layout (`msgpack`).
- `publisher`: the engine's ZMQ PUB socket and ROUTER replay socket (`pyzmq`), one batch per
  engine step with a sequence number.
- `subscriber`: the other end (asyncio): follows a publisher's stream into a view of its cache,
  replaying what it missed (the router's `cache_aware` policy with `--router-kv-events`).

See docs/features/kv_cache_and_tiers.md#kv-cache-events.
"""
