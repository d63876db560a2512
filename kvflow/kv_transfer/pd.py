"""Prefill/decode disaggregation: a producer engine hands a finished prompt's KV blocks to a
consumer engine (vLLM's kv_producer / kv_consumer, pull model like its NIXL connector).

1. The producer gets a request with kv_transfer_params {"do_remote_decode": true} (the router sends
   it with max_tokens=1). When it finishes, its blocks are held under a transfer id for a lease,
   and the output's kv_transfer_params say where to fetch them (host, port, transfer id, blocks).
2. The consumer gets the original request plus those params. At admission it allocates blocks for
   the remote prefix and fetches them in a background thread; the request waits, computing
   nothing, while other requests run. When the blocks arrive (checksum and chained hashes verified)
   they are written into the pool and enter its prefix cache; the request is requeued and finds
   them as prefix hits, so the decode engine computes only the prompt's tail (under one block).
3. The consumer then tells the producer to release; a consumer that never comes is covered by
   the lease. A fetch that fails (timeout, corrupt payload, producer gone, other prompt) is
   recomputed on the decode side, or fails the request under kv_load_failure_policy "fail".

Transports: "tcp" sends the payload on the connection; "shm" (one host) writes it to a /dev/shm
file and sends only the header. Messages are declared frames (wire.py), never pickle.
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import tempfile
import threading
import time
import uuid
from collections import Counter, deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from kvflow.config import KVTransferConfig
from kvflow.kv_transfer.base import KVConnectorMetadata, KVConnectorOutput, KVConnectorScheduler, KVConnectorWorker
from kvflow.kv_transfer.wire import (
    BlockManifest,
    WireError,
    digest,
    manifest_header,
    recv_exact,
    recv_header,
    send_frame,
)

if TYPE_CHECKING:
    from kvflow.core.request import Request

logger = logging.getLogger("kvflow")

_SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


@dataclass
class RemoteLoad:
    request_id: str
    block_ids: list[int]  # where the blocks land in this pool
    block_hashes: list[str]  # what they must be (hex chained hashes of this engine's own tokens)
    first_block: int  # index of the first one in the producer's held list
    host: str
    port: int
    transfer_id: str


@dataclass
class HeldTransfer:
    transfer_id: str
    block_ids: list[int]
    block_hashes: list[str]


@dataclass
class PDMetadata(KVConnectorMetadata):
    loads: list[RemoteLoad] = field(default_factory=list)
    holds: list[HeldTransfer] = field(default_factory=list)
    cancels: list[str] = field(default_factory=list)  # request ids whose loads must not land
    # (host, port, transfer id) of transfers this engine will not fetch (it had the blocks already)
    releases: list[tuple[str, int, str]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not (self.loads or self.holds or self.cancels or self.releases)


@dataclass
class KVTransferStats:
    transfers_sent: int = 0
    blocks_sent: int = 0
    bytes_sent: int = 0
    transfers_received: int = 0
    blocks_received: int = 0
    bytes_received: int = 0
    leases_expired: int = 0
    failures: Counter = field(default_factory=Counter)  # reason -> count (consumer side)
    # Recent fetch durations (s), drained by the metrics exporter; and all of them, summed.
    recent_seconds: deque = field(default_factory=lambda: deque(maxlen=4096))
    seconds_total: float = 0.0

    def snapshot(self) -> KVTransferStats:
        return KVTransferStats(
            self.transfers_sent,
            self.blocks_sent,
            self.bytes_sent,
            self.transfers_received,
            self.blocks_received,
            self.bytes_received,
            self.leases_expired,
            Counter(self.failures),
            deque(),
            self.seconds_total,
        )


class TransferFailed(Exception):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def check_transfer_params(params: dict[str, Any], config: KVTransferConfig | None) -> None:
    """A request's kv_transfer_params, before it is queued (bad ones are the client's 400)."""
    if params.get("do_remote_decode") and (config is None or not config.is_producer):
        raise ValueError(
            "kv_transfer_params asks for do_remote_decode, but this engine is not a KV producer "
            '(start it with --kv-transfer-config \'{"kv_connector": "tcp", '
            '"kv_role": "kv_producer"}\')'
        )
    if params.get("do_remote_prefill"):
        if config is None or not config.is_consumer:
            raise ValueError(
                "kv_transfer_params asks for do_remote_prefill, but this engine is not a KV consumer "
                '(start it with --kv-transfer-config \'{"kv_connector": "tcp", '
                '"kv_role": "kv_consumer"}\')'
            )
        for key, kind in (
            ("remote_host", str),
            ("remote_port", int),
            ("remote_transfer_id", str),
            ("remote_num_blocks", int),
            ("remote_block_size", int),
        ):
            value = params.get(key)
            if not isinstance(value, kind) or isinstance(value, bool):
                raise ValueError(f"kv_transfer_params.{key} must be a {kind.__name__}, got {value!r}")
        if not 0 < params["remote_port"] < 65536:
            raise ValueError(f"kv_transfer_params.remote_port must be in [1, 65535], got {params['remote_port']}")
        if params["remote_num_blocks"] < 0:
            raise ValueError("kv_transfer_params.remote_num_blocks must be >= 0")


class PDConnectorScheduler(KVConnectorScheduler):
    def __init__(self, config: KVTransferConfig, block_size: int, address: tuple[str, int] | None) -> None:
        """`address`: where this producer's block server listens (None on a pure consumer); it goes
        into the kv_transfer_params a finished request returns."""
        self.config = config
        self.block_size = block_size
        self.load_failure_policy = config.kv_load_failure_policy
        self._address = address
        self._engine_id = config.engine_id or uuid.uuid4().hex[:12]
        self._ids = itertools.count()
        self._loads: list[RemoteLoad] = []
        self._holds: list[HeldTransfer] = []
        self._cancels: list[str] = []
        self._releases: list[tuple[str, int, str]] = []
        self._matched: dict[str, tuple[dict[str, Any], int, int]] = {}
        self._loading: set[str] = set()
        self._handled: set[str] = set()  # remote KV already loaded or given up: never fetched again
        self._held: set[str] = set()

    def check_request(self, params: dict[str, Any] | None) -> None:
        if params:
            check_transfer_params(params, self.config)

    def get_num_new_matched_tokens(self, req: Request, num_computed_tokens: int) -> tuple[int, bool]:
        params = req.params.kv_transfer_params
        rid = req.request_id
        if not params or not params.get("do_remote_prefill") or rid in self._handled:
            return 0, False
        bs = self.block_size
        if params["remote_block_size"] != bs:
            logger.warning(
                "request %s: the producer's block size %d differs from ours (%d); recomputing",
                rid,
                params["remote_block_size"],
                bs,
            )
            self._handled.add(rid)
            return 0, False
        start = num_computed_tokens // bs
        end = min(params["remote_num_blocks"], (req.num_tokens - 1) // bs)  # leave a token to sample from
        if end <= start:  # everything the producer has is in our own prefix cache already
            self._handled.add(rid)
            self._releases.append((params["remote_host"], params["remote_port"], params["remote_transfer_id"]))
            return 0, False
        self._matched[rid] = (params, start, end)
        return (end - start) * bs, True

    def update_state_after_alloc(self, req: Request, block_ids: list[int], num_external_tokens: int) -> None:
        params, start, end = self._matched.pop(req.request_id)
        self._loads.append(
            RemoteLoad(
                req.request_id,
                block_ids,
                [h.hex() for h in req.block_hashes[start:end]],
                start,
                params["remote_host"],
                params["remote_port"],
                params["remote_transfer_id"],
            )
        )
        self._loading.add(req.request_id)

    def build_connector_meta(self) -> PDMetadata:
        meta = PDMetadata(self._loads, self._holds, self._cancels, self._releases)
        self._loads, self._holds, self._cancels, self._releases = [], [], [], []
        self._matched.clear()
        return meta

    def request_finished(self, req: Request, block_ids: list[int]) -> tuple[str | None, dict[str, Any] | None]:
        rid = req.request_id
        if rid in self._loading:  # aborted while its KV was on the way: the bytes must not land
            self._loading.discard(rid)
            self._cancels.append(rid)
        self._handled.discard(rid)
        params = req.params.kv_transfer_params
        if not (params and params.get("do_remote_decode") and self.config.is_producer):
            return None, None
        if req.status.value not in ("stop", "length"):  # aborted or failed: nothing to hand over
            return None, None
        n = min(len(req.prompt_token_ids) // self.block_size, len(req.block_hashes), len(block_ids))
        if n == 0:  # a prompt shorter than one block: the decode engine computes it
            return None, None
        key = f"{self._engine_id}-{next(self._ids)}"
        self._holds.append(HeldTransfer(key, block_ids[:n], [h.hex() for h in req.block_hashes[:n]]))
        self._held.add(key)
        host, port = self._address
        return key, {
            "do_remote_prefill": True,
            "remote_engine_id": self._engine_id,
            "remote_host": host,
            "remote_port": port,
            "remote_transfer_id": key,
            "remote_num_blocks": n,
            "remote_block_size": self.block_size,
        }

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        self._held -= output.finished_sending
        for rid in (*output.finished_recving, *output.failed_recving):
            self._loading.discard(rid)
            self._handled.add(rid)

    def has_pending(self) -> bool:
        return bool(self._held or self._loading or self._holds or self._loads or self._cancels or self._releases)


@dataclass
class _Held:
    transfer: HeldTransfer
    deadline: float
    sending: int = 0  # fetches reading these blocks now: the lease cannot expire under them
    # The blocks read when the hold began, where the block IO's reads are collectives that only the
    # engine thread may start (tensor parallelism); None: the fetch reads the pool itself.
    data: torch.Tensor | None = None


class PDConnectorWorker(KVConnectorWorker):
    def __init__(self, config: KVTransferConfig, identity: str, kv_cache_dtype: str, num_layers: int) -> None:
        self.config = config
        self.identity = identity
        self.kv_cache_dtype = kv_cache_dtype
        self.num_layers = num_layers
        self._stats = KVTransferStats()
        self._lock = threading.Lock()
        self._held: dict[str, _Held] = {}
        self._sent: set[str] = set()
        self._loads: dict[str, tuple[RemoteLoad, Future]] = {}
        self._fetchers = ThreadPoolExecutor(2, thread_name_prefix="kvflow-kv-fetch") if config.is_consumer else None
        self._server: BlockServer | None = None
        self._block_bytes = 0

    def register_kv_caches(self, io) -> None:
        super().register_kv_caches(io)
        self._block_bytes = (
            torch.empty(io.kv_block_shape, dtype=io.kv_block_dtype).numel()
            * torch.empty((), dtype=io.kv_block_dtype).element_size()
        )
        if self.config.is_producer:
            self._server = BlockServer(
                self.config.kv_ip, self.config.kv_port, self._serve, self.config.kv_transfer_timeout_s
            )

    @property
    def address(self) -> tuple[str, int]:
        if self._server is None:
            raise RuntimeError("this engine is not a KV producer")
        return self.config.kv_ip, self._server.port

    # ---- the engine thread ----------------------------------------------------------------------
    def start_load_kv(self, meta: PDMetadata) -> None:
        for rid in meta.cancels:
            self._loads.pop(rid, None)  # a fetch still running finishes into nothing
        if meta.holds:
            deadline = time.monotonic() + self.config.kv_lease_s
            held = [
                _Held(h, deadline, data=self.io.read_blocks(h.block_ids) if self.io.collective else None)
                for h in meta.holds
            ]
            with self._lock:
                for h in held:
                    self._held[h.transfer.transfer_id] = h
        for load in meta.loads:
            self._loads[load.request_id] = (load, self._fetchers.submit(self._fetch, load))
        for host, port, tid in meta.releases:
            self._fetchers.submit(self._release, host, port, tid)

    def get_finished(self) -> KVConnectorOutput:
        out = KVConnectorOutput()
        for rid, (load, fut) in list(self._loads.items()):
            if not fut.done():
                continue
            del self._loads[rid]
            try:
                data = fut.result()
            except TransferFailed as e:
                logger.warning(
                    "request %s: KV fetch from %s:%d failed (%s): %s", rid, load.host, load.port, e.reason, e
                )
                self._stats.failures[e.reason] += 1
                out.failed_recving[rid] = f"KV transfer failed ({e.reason}): {e}"
                continue
            # The blocks are this waiting request's: nothing else reads or writes them until it runs.
            self.io.write_blocks(load.block_ids, data)
            out.finished_recving.add(rid)
        now = time.monotonic()
        with self._lock:
            out.finished_sending, self._sent = self._sent, set()
            for tid, held in list(self._held.items()):
                if held.sending == 0 and now > held.deadline:
                    del self._held[tid]
                    out.finished_sending.add(tid)
                    self._stats.leases_expired += 1
                    logger.warning(
                        "KV transfer %s: no consumer fetched it within the %gs lease; blocks freed",
                        tid,
                        self.config.kv_lease_s,
                    )
        return out

    def stats(self) -> KVTransferStats:
        with self._lock:  # fetch and server threads update it under the lock
            return self._stats.snapshot()

    def take_transfer_times(self) -> list[float]:
        recent, times = self._stats.recent_seconds, []
        while recent:  # appended by fetch threads; deque appends and pops are thread-safe
            times.append(recent.popleft())
        return times

    def shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        if self._fetchers is not None:
            self._fetchers.shutdown(wait=False, cancel_futures=True)

    # ---- consumer: a fetch thread ---------------------------------------------------------------
    def _fetch(self, load: RemoteLoad) -> torch.Tensor:
        timeout = self.config.kv_transfer_timeout_s
        t0 = time.perf_counter()
        try:
            with socket.create_connection((load.host, load.port), timeout=timeout) as sock:
                sock.settimeout(timeout)
                send_frame(
                    sock,
                    {
                        "op": "fetch",
                        "transfer_id": load.transfer_id,
                        "first_block": load.first_block,
                        "num_blocks": len(load.block_ids),
                        "identity": self.identity,
                        "transport": self.config.kv_connector,
                    },
                )
                header = recv_header(sock)
                if not header.get("ok"):
                    raise TransferFailed("refused", f"the producer refused: {header.get('error')}")
                try:
                    m = BlockManifest.from_dict(header.get("manifest") or {})
                    self._check_manifest(m, load)
                    payload = (
                        _read_shm(header["shm_path"], m.nbytes) if "shm_path" in header else recv_exact(sock, m.nbytes)
                    )
                    if digest(payload) != m.sha256:
                        raise TransferFailed("checksum", "the payload's sha256 does not match its manifest")
                finally:  # we will not ask again, good bytes or bad: the producer may free them now
                    _try_send(sock, {"op": "release", "transfer_id": load.transfer_id})
        except TimeoutError:
            raise TransferFailed("timeout", f"no answer within kv_transfer_timeout_s={timeout:g}") from None
        except (OSError, WireError) as e:
            raise TransferFailed("connection", f"{type(e).__name__}: {e}") from None
        data = torch.frombuffer(payload, dtype=self.io.kv_block_dtype).view(
            len(load.block_ids), *self.io.kv_block_shape
        )
        with self._lock:
            s = self._stats
            s.transfers_received += 1
            s.blocks_received += len(load.block_ids)
            s.bytes_received += m.nbytes
            seconds = time.perf_counter() - t0
            s.recent_seconds.append(seconds)
            s.seconds_total += seconds
        return data

    def _release(self, host: str, port: int, transfer_id: str) -> None:
        """Tell a producer we will not fetch (best effort: its lease covers a lost message)."""
        try:
            with socket.create_connection((host, port), timeout=self.config.kv_transfer_timeout_s) as sock:
                send_frame(sock, {"op": "release", "transfer_id": transfer_id})
        except OSError as e:
            logger.info("KV transfer %s: release not delivered (%s); the producer's lease frees it", transfer_id, e)

    def _check_manifest(self, m: BlockManifest, load: RemoteLoad) -> None:
        if m.identity != self.identity:
            raise TransferFailed("identity", "the producer runs another model or KV layout")
        if m.block_hashes != load.block_hashes:
            raise TransferFailed("prefix_mismatch", "the producer's blocks hold other tokens than this prompt")
        if (
            list(m.block_shape) != list(self.io.kv_block_shape)
            or m.dtype != _dtype_name(self.io.kv_block_dtype)
            or m.kv_cache_dtype != self.kv_cache_dtype
            or tuple(m.layers) != (0, self.num_layers)
            or m.nbytes != len(load.block_ids) * self._block_bytes
        ):
            raise TransferFailed(
                "layout",
                f"block layout {m.block_shape} {m.dtype} (kv_cache_dtype {m.kv_cache_dtype!r}) does not match "
                f"ours {list(self.io.kv_block_shape)} {_dtype_name(self.io.kv_block_dtype)} "
                f"(kv_cache_dtype {self.kv_cache_dtype!r})",
            )

    # ---- producer: a server thread --------------------------------------------------------------
    def _serve(self, conn: socket.socket, header: dict[str, Any]) -> None:
        if header.get("op") == "release":
            self._released(header.get("transfer_id"), 0, 0)
        else:
            self._serve_fetch(conn, header)

    def _released(self, tid: Any, num_blocks: int, nbytes: int) -> None:
        with self._lock:
            held = self._held.get(tid) if isinstance(tid, str) else None
            if held is None:
                return
            del self._held[tid]
            self._sent.add(tid)
            if num_blocks:
                self._stats.transfers_sent += 1
                self._stats.blocks_sent += num_blocks
                self._stats.bytes_sent += nbytes

    def _serve_fetch(self, conn: socket.socket, header: dict[str, Any]) -> None:
        tid = header.get("transfer_id")
        with self._lock:
            held = self._held.get(tid) if isinstance(tid, str) else None
            if held is not None:
                held.sending += 1
        if held is None:
            send_frame(conn, {"ok": False, "error": f"unknown or expired transfer {tid!r}"})
            return
        shm_path = None
        try:
            first, num = header.get("first_block"), header.get("num_blocks")
            t = held.transfer
            if header.get("identity") != self.identity:
                send_frame(conn, {"ok": False, "error": "identity mismatch: another model or KV layout"})
                return
            if not (
                isinstance(first, int)
                and isinstance(num, int)
                and first >= 0
                and num > 0
                and first + num <= len(t.block_ids)
            ):
                send_frame(
                    conn,
                    {
                        "ok": False,
                        "error": f"blocks [{first}, {first}+{num}) are not within the {len(t.block_ids)} held",
                    },
                )
                return
            # Held blocks: the engine writes none of them while the transfer lasts.
            data = (
                held.data[first : first + num]
                if held.data is not None
                else self.io.read_blocks(t.block_ids[first : first + num])
            ).contiguous()
            payload = self._payload(data)
            m = BlockManifest(
                self.identity,
                t.block_hashes[first : first + num],
                first,
                (0, self.num_layers),
                _dtype_name(data.dtype),
                list(data.shape[1:]),
                self.kv_cache_dtype,
                len(payload),
                digest(payload),
            )
            if header.get("transport") == "shm":
                shm_path = _write_shm(payload)
                send_frame(conn, manifest_header(m, shm_path=shm_path))
            else:
                send_frame(conn, manifest_header(m), payload)
            reply = recv_header(conn)
            if reply.get("op") == "release" and reply.get("transfer_id") == tid:
                self._released(tid, num, len(payload))
        finally:
            with self._lock:
                held.sending -= 1
            if shm_path is not None and os.path.exists(shm_path):
                os.unlink(shm_path)  # the consumer normally removed it already

    def _payload(self, data: torch.Tensor) -> memoryview:
        return memoryview(data.view(torch.uint8).reshape(-1).numpy())


def _try_send(sock: socket.socket, header: dict[str, Any]) -> None:
    try:
        send_frame(sock, header)
    except OSError:
        pass  # the producer is gone; its lease (if it is alive) frees the blocks


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _write_shm(payload: memoryview) -> str:
    fd, path = tempfile.mkstemp(dir=_SHM_DIR, prefix="kvflow-kv-")
    with os.fdopen(fd, "wb") as f:
        f.write(payload)
    return path


def _read_shm(path: Any, nbytes: int) -> bytearray:
    if not isinstance(path, str) or not os.path.basename(path).startswith("kvflow-kv-"):
        raise WireError(f"not a kvflow shared-memory path: {path!r}")
    try:
        with open(path, "rb") as f:
            buf = bytearray(f.read(nbytes + 1))
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass
    if len(buf) != nbytes:
        raise WireError(f"shared-memory payload has {len(buf)} bytes, the manifest says {nbytes}")
    return buf


class BlockServer:
    """The producer's listener: one thread accepting, one short-lived thread per fetch."""

    def __init__(self, host: str, port: int, handler, timeout_s: float) -> None:
        try:
            self._sock = socket.create_server((host, port))
        except OSError as e:
            raise ValueError(
                f"kv_transfer_config: the KV producer cannot listen on {host}:{port} ({e}); "
                "choose another kv_port (0 = any free one) or kv_ip"
            ) from None
        self.port = self._sock.getsockname()[1]
        self._handler = handler
        self._timeout = timeout_s
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name="kvflow-kv-server", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.settimeout(self._timeout)
                header = recv_header(conn)
                if header.get("op") not in ("fetch", "release"):
                    send_frame(conn, {"ok": False, "error": f"unknown op {header.get('op')!r}"})
                    return
                self._handler(conn, header)
            except (OSError, WireError) as e:
                logger.info("KV transfer connection ended early: %s", e)
            except Exception:
                logger.exception("KV transfer: serving a fetch failed")

    def close(self) -> None:
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
