"""Prefill/decode disaggregation on a small CPU: 1P1D (one core each), plain and conditional,
against one aggregated engine (two cores, chunked prefill), under the same chat + long-document
workload.

    .venv/bin/python benchmarks/pd_disagg.py [--setups agg,pd,pd_cond] [--max-local-prefill-length 512]
        [--connector tcp|shm] [--chunk-size 512]
        [--duration-s 120] [--chat-users 4] [--chat-prompt-len 64] [--chat-output-len 128]
        [--doc-rate 0.1] [--doc-min-len 2048] [--doc-max-len 4096] [--doc-output-len 32]
        [--seed 0] [--server-args "--model DIR ..."] [--result-json FILE]

Setups (each started, measured and stopped in turn, aggregated first):

- `agg`: one `kvflow serve --max-num-batched-tokens C` pinned to two cores (`taskset -c 0,1`,
  OMP_NUM_THREADS=2): chats' decode steps and documents' prefill chunks share every step.
- `pd`: a prefill engine (kv_producer) on core 0 and a decode engine (kv_consumer) on core 1, one
  thread each, both with --max-num-batched-tokens C, and `kvflow router` (unpinned) in front: each
  request is prefilled on the producer, then generated on the consumer, which fetches the prompt's
  KV blocks over --connector (tcp or shm).
- `pd_cond`: the same 1P1D pair, its router started with `--max-local-prefill-length N`
  (conditional disaggregation): a prompt whose tokens the decode engine would compute, as the
  router estimates them, are at most N goes to the decode engine alone, which prefills it itself;
  longer ones through the prefill engine. The default N (512) keeps the 64-token chats local and
  sends the 2-4k-token documents through the prefill engine.

kvflow sets no torch thread count of its own, so OMP_NUM_THREADS (and MKL_NUM_THREADS) decide
it. Without `taskset` (or with fewer than two usable CPUs) the servers run unpinned, and the
output says so. The harness and the router are not pinned: on a two-core machine they take some
of the same cores.

Workload, the same for both setups (--seed): --chat-users closed-loop clients for --duration-s,
each sending a streamed completion (prompt --chat-prompt-len tokens, max_tokens --chat-output-len,
ignore_eos, temperature 0) and the next one when it finishes; meanwhile long documents arrive as a
Poisson stream at --doc-rate req/s, prompts uniform in [--doc-min-len, --doc-max-len] tokens,
max_tokens --doc-output-len. Prompts are random word-piece text of an exact token length (the
served model's tokenizer, kvflow.bench.datasets), every one distinct, so no two requests share a
prefix-cache block. One chat and one short document warm each setup up, untimed. After
--duration-s no new request starts; those in flight finish (up to --drain-timeout-s).

Per setup: chats' ITL p50/p99 and TPOT p50/p99 (ms) and how many finished; documents' TTFT
p50/p99/mean (s), finished/failed; output tokens/s over all requests. For pd and pd_cond also the
KV transfer from the consumer's /metrics (the timed run only: after minus before): bytes received,
fetches, transfer seconds, GB/s, failures by reason, the router's prefill fallbacks and (pd_cond)
its decisions (kvflow_router:pd_decisions_total: prompts prefilled on the decode engine / on the
prefill engine). The engine's
transfer histogram does not tell documents from chats, so a document's transfer time is given as
a range, alone and as a share of the documents' mean TTFT: from the mean fetch time (as if every
fetch cost the same) to the transfer seconds split by the KV blocks each request moved (as if
time were proportional to bytes); with a fixed cost per fetch plus a cost per block, the truth
lies in between (pd_cond: only requests whose prompt is longer than N count as transferred). Then
one table: each 1P1D setup and its ratio to aggregated for chat ITL p99, chat TPOT p99, document
TTFT p50 and throughput, under the CPU line.

Each subprocess's output goes to a log file in a temporary folder (printed at start, and again
with the log's last lines when a server fails to start). Servers are stopped (SIGTERM, SIGKILL
after --stop-timeout) on every exit path, Ctrl-C included.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import signal
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from kvflow.bench.report import cpu_line, percent, ratio  # tests read cpu_line and ratio here too
from kvflow.bench.report import fmt_num as _f
from kvflow.bench.servers import (
    add_harness_args,
    flag_value,
    harness_tokenizer,
    nonneg_finite_float,
    nonneg_int,
    parse_server_flags,
    pinning_cpus,
    positive_finite_float,
    scrape,
    served_model,
    server_max_model_len,
    thread_env,
)
from kvflow.cli.bench import _positive_int
from kvflow.utils.processes import ManagedProcess, ServerError, exit_on_sigterm, free_port, pinned, started
from kvflow.utils.prometheus import by_label, parse_prometheus, sample_sum

SETUPS = ("agg", "pd", "pd_cond")
SETUP_LABELS = {"agg": "aggregated", "pd": "1P1D", "pd_cond": "1P1D conditional"}
PD_SETUPS = ("pd", "pd_cond")  # a prefill engine, a decode engine and a router
DEFAULT_MAX_LOCAL_PREFILL = 512  # pd_cond: between the default chats (64) and documents (2048+)
CONNECTORS = ("tcp", "shm")
# Flags the harness sets itself on every engine: they may not come in --server-args.
OWN_FLAGS = ("--port", "--host", "--max-num-batched-tokens", "--kv-transfer-config")
PYTHON_CMD = [sys.executable, "-m", "kvflow.cli.main"]
DEFAULT_BLOCK_SIZE = 16  # kvflow serve --block-size
# Independent seeded streams of one --seed (numpy seed sequences [seed, stream, ...]).
DOC_ARRIVALS, DOC_LENGTHS, DOC_PROMPTS, CHAT_PROMPTS, WARM_PROMPTS = range(5)

# ----------------------------------------------------------------------------------------------
# Arguments
# ----------------------------------------------------------------------------------------------


def parse_setups(spec: str) -> list[str]:
    """'agg,pd_cond' -> ['agg', 'pd_cond'] (order kept, duplicates dropped)."""
    names = list(dict.fromkeys(p.strip() for p in spec.split(",") if p.strip()))
    bad = [n for n in names if n not in SETUPS]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"setups must be among {','.join(SETUPS)}, got {spec!r}")
    return names


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--setups",
        type=parse_setups,
        default=list(SETUPS),
        help="comma-separated, run in this order: agg (one 2-core engine), pd (1P1D), pd_cond (1P1D, "
        "short prompts prefilled on the decode engine) (default agg,pd,pd_cond)",
    )
    ap.add_argument(
        "--max-local-prefill-length",
        type=_positive_int,
        default=DEFAULT_MAX_LOCAL_PREFILL,
        metavar="TOKENS",
        help="pd_cond: the router's --max-local-prefill-length (prompts the decode engine would compute "
        f"at most this many tokens of skip the prefill engine) (default {DEFAULT_MAX_LOCAL_PREFILL})",
    )
    ap.add_argument("--connector", choices=CONNECTORS, default="tcp", help="pd: kv_connector (default tcp)")
    ap.add_argument(
        "--chunk-size", type=_positive_int, default=512, help="--max-num-batched-tokens of every engine (default 512)"
    )
    ap.add_argument(
        "--duration-s",
        type=positive_finite_float,
        default=120.0,
        help="seconds during which new requests start (default 120)",
    )
    ap.add_argument("--chat-users", type=nonneg_int, default=4, help="closed-loop chat clients (default 4)")
    ap.add_argument("--chat-prompt-len", type=_positive_int, default=64, help="chat prompt tokens (default 64)")
    ap.add_argument("--chat-output-len", type=_positive_int, default=128, help="chat max_tokens (default 128)")
    ap.add_argument(
        "--doc-rate",
        type=nonneg_finite_float,
        default=0.1,
        help="long documents per second, Poisson (0: none) (default 0.1)",
    )
    ap.add_argument("--doc-min-len", type=_positive_int, default=2048, help="shortest document prompt (default 2048)")
    ap.add_argument("--doc-max-len", type=_positive_int, default=4096, help="longest document prompt (default 4096)")
    ap.add_argument("--doc-output-len", type=_positive_int, default=32, help="document max_tokens (default 32)")
    ap.add_argument(
        "--drain-timeout-s",
        type=positive_finite_float,
        default=600.0,
        help="after --duration-s, seconds to wait for requests in flight (default 600)",
    )
    add_harness_args(ap, stop_timeout_s=30.0)
    return ap


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = build_parser()
    args = ap.parse_args(argv)
    parse_server_flags(ap, args, OWN_FLAGS, "--chunk-size sets --max-num-batched-tokens")
    if args.doc_min_len > args.doc_max_len:
        ap.error("--doc-min-len must be <= --doc-max-len")
    if args.chat_users == 0 and args.doc_rate == 0:
        ap.error("nothing to send: --chat-users 0 and --doc-rate 0")
    return args


# ----------------------------------------------------------------------------------------------
# Workload (pure, seeded)
# ----------------------------------------------------------------------------------------------


def poisson_offsets(rate: float, duration_s: float, seed: int) -> list[float]:
    """Arrival offsets (s) of a Poisson process at `rate` per second within [0, duration_s)."""
    import numpy as np

    if rate <= 0:
        return []
    rng = np.random.default_rng([seed, DOC_ARRIVALS])
    out: list[float] = []
    t = float(rng.exponential(1.0 / rate))
    while t < duration_s:
        out.append(t)
        t += float(rng.exponential(1.0 / rate))
    return out


def uniform_lengths(n: int, lo: int, hi: int, seed: int) -> list[int]:
    """n integers uniform on [lo, hi] (inclusive)."""
    import numpy as np

    rng = np.random.default_rng([seed, DOC_LENGTHS])
    return [int(x) for x in rng.integers(lo, hi + 1, size=n)]


def chat_seed(seed: int, user: int, index: int) -> list[int]:
    """The numpy seed of chat `index` of client `user`: the same prompt in every setup."""
    return [seed, CHAT_PROMPTS, user, index]


@dataclass
class DocArrival:
    offset_s: float
    request: Any  # BenchRequest


@dataclass
class Workload:
    """Everything sent: documents pre-built with their arrivals; chats built on demand from their seed."""

    builder: Any  # kvflow.bench.datasets.PromptBuilder
    seed: int
    chat_users: int
    chat_prompt_len: int
    chat_output_len: int
    docs: list[DocArrival]
    warm_up: list[Any]  # BenchRequest, untimed

    def chat_request(self, user: int, index: int) -> Any:
        import numpy as np

        from kvflow.bench.datasets import BenchRequest

        rng = np.random.default_rng(chat_seed(self.seed, user, index))
        prompt, n = self.builder.build(self.chat_prompt_len, rng)
        return BenchRequest(prompt=prompt, prompt_len=n, output_len=self.chat_output_len, request_class="chat")

    def longest_request(self) -> int:
        """Prompt + output tokens of the longest request."""
        chat = self.chat_prompt_len + self.chat_output_len if self.chat_users else 0
        docs = [d.request.prompt_len + d.request.output_len for d in self.docs]
        return max([chat, *docs, *(w.prompt_len + w.output_len for w in self.warm_up)])


def build_workload(args: argparse.Namespace, tokenizer: Any) -> Workload:
    import numpy as np

    from kvflow.bench.datasets import BenchRequest, PromptBuilder

    builder = PromptBuilder(tokenizer)
    offsets = poisson_offsets(args.doc_rate, args.duration_s, args.seed)
    lengths = uniform_lengths(len(offsets), args.doc_min_len, args.doc_max_len, args.seed)
    rng = np.random.default_rng([args.seed, DOC_PROMPTS])
    docs = []
    for off, n in zip(offsets, lengths):
        prompt, plen = builder.build(n, rng)
        docs.append(
            DocArrival(
                off, BenchRequest(prompt=prompt, prompt_len=plen, output_len=args.doc_output_len, request_class="doc")
            )
        )
    warm_rng = np.random.default_rng([args.seed, WARM_PROMPTS])
    warm = []
    if args.chat_users:
        prompt, plen = builder.build(args.chat_prompt_len, warm_rng)
        warm.append(
            BenchRequest(prompt=prompt, prompt_len=plen, output_len=min(8, args.chat_output_len), request_class="chat")
        )
    if args.doc_rate > 0:
        prompt, plen = builder.build(args.doc_min_len, warm_rng)
        warm.append(BenchRequest(prompt=prompt, prompt_len=plen, output_len=2, request_class="doc"))
    return Workload(builder, args.seed, args.chat_users, args.chat_prompt_len, args.chat_output_len, docs, warm)


# ----------------------------------------------------------------------------------------------
# Processes: servers and the router
# ----------------------------------------------------------------------------------------------


@dataclass
class ProcSpec:
    """One subprocess to start: its name (and log file name), argv, environment, port."""

    name: str
    argv: list[str]
    env: dict[str, str]
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def serve_spec(
    name: str,
    port: int,
    cpus: Sequence[int] | None,
    threads: int,
    chunk: int,
    server_flags: Sequence[str],
    kv_config: str | None = None,
) -> ProcSpec:
    argv = [*PYTHON_CMD, "serve", "--port", str(port), "--max-num-batched-tokens", str(chunk), *server_flags]
    if kv_config is not None:
        argv += ["--kv-transfer-config", kv_config]
    return ProcSpec(name, pinned(argv, cpus), thread_env(threads), port)


def kv_config(connector: str, role: str) -> str:
    import json

    return json.dumps({"kv_connector": connector, "kv_role": role})


def setup_specs(setup: str, args: argparse.Namespace, cpus: Sequence[int] | None) -> list[ProcSpec]:
    """The processes of one setup, in start order; the last one is what the client talks to."""
    if setup == "agg":
        return [serve_spec("agg-serve", free_port(), cpus, 2, args.chunk_size, args.server_flags)]
    p_cpus, d_cpus = ([cpus[0]], [cpus[1]]) if cpus is not None else (None, None)
    prefix = setup.replace("_", "-")  # log names: pd-prefill.log, pd-cond-prefill.log, ...
    prefill = serve_spec(
        f"{prefix}-prefill",
        free_port(),
        p_cpus,
        1,
        args.chunk_size,
        args.server_flags,
        kv_config(args.connector, "kv_producer"),
    )
    decode = serve_spec(
        f"{prefix}-decode",
        free_port(),
        d_cpus,
        1,
        args.chunk_size,
        args.server_flags,
        kv_config(args.connector, "kv_consumer"),
    )
    port = free_port()
    argv = [*PYTHON_CMD, "router", "--port", str(port), "--prefill", prefill.url, "--decode", decode.url]
    if setup == "pd_cond":
        argv += ["--max-local-prefill-length", str(args.max_local_prefill_length)]
    router = ProcSpec(f"{prefix}-router", argv, thread_env(1), port)
    return [prefill, decode, router]


@contextlib.contextmanager
def running(specs: Sequence[ProcSpec], log_dir: str, args: argparse.Namespace) -> Iterator[list[ManagedProcess]]:
    """Start every process in order (each healthy before the next), its log `<log_dir>/<name>.log`;
    stop them in reverse order."""
    procs = [
        ManagedProcess(
            s.argv,
            s.port,
            name=s.name,
            env=s.env,
            log_path=os.path.join(log_dir, f"{s.name}.log"),
            startup_timeout=args.startup_timeout,
            stop_timeout=args.stop_timeout,
        )
        for s in specs
    ]
    with started(procs):
        yield procs


# ----------------------------------------------------------------------------------------------
# KV transfer counters from /metrics (pure)
# ----------------------------------------------------------------------------------------------


@dataclass
class TransferStats:
    """The consumer's KV transfer counters over one timed run (after minus before)."""

    bytes_received: float = 0.0
    blocks_received: float = 0.0
    fetches: float = 0.0  # kvflow:kv_transfer_seconds_count
    seconds: float = 0.0  # kvflow:kv_transfer_seconds_sum
    failures: dict[str, float] = field(default_factory=dict)
    prefill_fallbacks: float | None = None  # the router's; None when it does not export them
    # the router's kvflow_router:pd_decisions_total; None when it does not export them
    local_prefills: float | None = None
    remote_prefills: float | None = None

    @property
    def gb_per_s(self) -> float | None:
        return self.bytes_received / self.seconds / 1e9 if self.seconds > 0 else None

    @property
    def mean_fetch_s(self) -> float | None:
        return self.seconds / self.fetches if self.fetches > 0 else None

    def to_dict(self) -> dict:
        return {**asdict(self), "gb_per_s": self.gb_per_s, "mean_fetch_s": self.mean_fetch_s}


def transfer_counters(text: str) -> TransferStats:
    s = parse_prometheus(text)
    return TransferStats(
        bytes_received=sample_sum(s, "kvflow:kv_transfer_bytes_total", direction="received"),
        blocks_received=sample_sum(s, "kvflow:kv_transfer_blocks_total", direction="received"),
        fetches=sample_sum(s, "kvflow:kv_transfer_seconds_count"),
        seconds=sample_sum(s, "kvflow:kv_transfer_seconds_sum"),
        failures=by_label(s, "kvflow:kv_transfer_failures_total", "reason"),
    )


def router_fallbacks(text: str) -> float | None:
    s = parse_prometheus(text)
    if not any(n == "kvflow_router:prefill_fallbacks_total" for n, _, _ in s):
        return None
    return sample_sum(s, "kvflow_router:prefill_fallbacks_total")


def router_decisions(text: str) -> tuple[float, float] | None:
    """(local_prefill, remote_prefill) from the router's kvflow_router:pd_decisions_total; None
    when it does not export them."""
    s = parse_prometheus(text)
    if not any(n == "kvflow_router:pd_decisions_total" for n, _, _ in s):
        return None
    return (
        sample_sum(s, "kvflow_router:pd_decisions_total", decision="local_prefill"),
        sample_sum(s, "kvflow_router:pd_decisions_total", decision="remote_prefill"),
    )


def _minus(after: float | None, before: float | None) -> float | None:
    return None if after is None else after - (before or 0.0)


def transfer_delta(before: TransferStats, after: TransferStats) -> TransferStats:
    reasons = sorted(set(before.failures) | set(after.failures))
    return TransferStats(
        bytes_received=after.bytes_received - before.bytes_received,
        blocks_received=after.blocks_received - before.blocks_received,
        fetches=after.fetches - before.fetches,
        seconds=after.seconds - before.seconds,
        failures={r: after.failures.get(r, 0.0) - before.failures.get(r, 0.0) for r in reasons},
        prefill_fallbacks=_minus(after.prefill_fallbacks, before.prefill_fallbacks),
        local_prefills=_minus(after.local_prefills, before.local_prefills),
        remote_prefills=_minus(after.remote_prefills, before.remote_prefills),
    )


# ----------------------------------------------------------------------------------------------
# Figures of a run (pure)
# ----------------------------------------------------------------------------------------------


@dataclass
class LoadSummary:
    chats_finished: int
    chats_failed: int
    chat_itl_ms_p50: float | None
    chat_itl_ms_p99: float | None
    chat_tpot_ms_p50: float | None
    chat_tpot_ms_p99: float | None
    docs_finished: int
    docs_failed: int
    doc_ttft_s_p50: float | None
    doc_ttft_s_p99: float | None
    doc_ttft_s_mean: float | None
    output_tokens: int
    duration_s: float
    output_throughput: float | None  # tokens/s, every finished request


def _percentile(values: Sequence[float], q: float, scale: float = 1.0) -> float | None:
    from kvflow.bench.metrics import percentile

    return percentile(values, q) * scale if values else None


def summarize_load(records: Sequence[Any], duration_s: float) -> LoadSummary:
    """The figures of one timed run from its RequestRecords (request_class 'chat' or 'doc')."""
    from kvflow.bench.metrics import itl, tpot, ttft

    chats = [r for r in records if r.request_class == "chat"]
    docs = [r for r in records if r.request_class == "doc"]
    ok_chats, ok_docs = [r for r in chats if r.success], [r for r in docs if r.success]
    gaps = [g for r in ok_chats for g in itl(r)]
    tpots = [v for v in map(tpot, ok_chats) if v is not None]
    ttfts = [v for v in map(ttft, ok_docs) if v is not None]
    out_tokens = sum(r.output_tokens for r in records if r.success)
    return LoadSummary(
        chats_finished=len(ok_chats),
        chats_failed=len(chats) - len(ok_chats),
        chat_itl_ms_p50=_percentile(gaps, 50, 1e3),
        chat_itl_ms_p99=_percentile(gaps, 99, 1e3),
        chat_tpot_ms_p50=_percentile(tpots, 50, 1e3),
        chat_tpot_ms_p99=_percentile(tpots, 99, 1e3),
        docs_finished=len(ok_docs),
        docs_failed=len(docs) - len(ok_docs),
        doc_ttft_s_p50=_percentile(ttfts, 50),
        doc_ttft_s_p99=_percentile(ttfts, 99),
        doc_ttft_s_mean=sum(ttfts) / len(ttfts) if ttfts else None,
        output_tokens=out_tokens,
        duration_s=duration_s,
        output_throughput=out_tokens / duration_s if duration_s > 0 else None,
    )


@dataclass
class DocTransfer:
    """A document's KV transfer time, bracketed: the engine's histogram has no per-request label.
    With a fetch costing o + k x blocks (o, k >= 0) and documents moving more blocks than the
    average request, the truth lies between the mean fetch (`low`: every fetch costs the same) and
    the transfer seconds split in proportion to the blocks moved (`high`: no fixed cost)."""

    block_share: float | None  # documents' blocks / every transferred request's
    per_doc_s_low: float | None
    per_doc_s_high: float | None
    share_of_ttft_low: float | None  # per_doc_s / documents' mean TTFT
    share_of_ttft_high: float | None


def moved_blocks(prompt_len: int, block_size: int) -> int:
    """Blocks a decode engine fetches for a prompt: the full blocks before its last token (which
    the decode engine computes itself, to sample from)."""
    return max(0, (prompt_len - 1) // block_size)


def doc_transfer(
    stats: TransferStats, records: Sequence[Any], doc_ttft_mean_s: float | None, block_size: int = 16
) -> DocTransfer:
    ok = [r for r in records if r.success]
    docs = [r for r in ok if r.request_class == "doc"]
    all_blocks = sum(moved_blocks(r.prompt_len, block_size) for r in ok)
    if not docs or all_blocks <= 0 or stats.fetches <= 0:
        return DocTransfer(None, None, None, None, None)
    share = sum(moved_blocks(r.prompt_len, block_size) for r in docs) / all_blocks
    high = stats.seconds * share / len(docs)
    low = min(stats.seconds / stats.fetches, high)
    return DocTransfer(share, low, high, ratio(low, doc_ttft_mean_s), ratio(high, doc_ttft_mean_s))


COMPARED = (
    ("chat ITL p99 (ms)", "chat_itl_ms_p99"),
    ("chat TPOT p99 (ms)", "chat_tpot_ms_p99"),
    ("doc TTFT p50 (s)", "doc_ttft_s_p50"),
    ("output throughput (tok/s)", "output_throughput"),
)


def comparison_rows(agg: LoadSummary, *pds: LoadSummary) -> list[list[Any]]:
    """Per compared figure: its label, the aggregated value, each 1P1D setup's, then each one's
    ratio to the aggregated value."""
    rows = []
    for label, key in COMPARED:
        a, ps = getattr(agg, key), [getattr(p, key) for p in pds]
        rows.append([label, a, *ps, *(ratio(p, a) for p in ps)])
    return rows


# ----------------------------------------------------------------------------------------------
# The load
# ----------------------------------------------------------------------------------------------


@dataclass
class LoadRun:
    records: list[Any]
    duration_s: float


async def _send(client: Any, cfg: Any, req: Any, rec: Any, model: str, tokenizer: Any) -> Any:
    from kvflow.bench.serve_client import send_request

    rec.arrival_time = time.perf_counter()
    return await send_request(client, cfg, req, rec, model, tokenizer)


async def _chat_user(
    client: Any, cfg: Any, w: Workload, user: int, deadline: float, model: str, tokenizer: Any, records: list[Any]
) -> None:
    from kvflow.bench.serve_client import new_record

    index = 0
    while time.perf_counter() < deadline:
        req = w.chat_request(user, index)
        rec = new_record(index, req, math.nan)
        rec.request_id, rec.user = f"chat-{user}-{index}", f"chat-{user}"
        records.append(rec)
        await _send(client, cfg, req, rec, model, tokenizer)
        if not rec.success:
            await asyncio.sleep(1.0)  # a failing server: do not spin
        index += 1


async def _doc(
    client: Any, cfg: Any, i: int, d: DocArrival, start: float, model: str, tokenizer: Any, records: list[Any]
) -> None:
    from kvflow.bench.serve_client import new_record

    delay = start + d.offset_s - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    rec = new_record(f"doc-{i}", d.request, math.nan)
    records.append(rec)
    await _send(client, cfg, d.request, rec, model, tokenizer)


async def _progress(records: list[Any], start: float, every_s: float = 30.0) -> None:
    while True:
        await asyncio.sleep(every_s)
        done = [r for r in records if r.end_time is not None]
        chats = sum(1 for r in done if r.request_class == "chat" and r.success)
        docs = sum(1 for r in done if r.request_class == "doc" and r.success)
        failed = sum(1 for r in done if not r.success)
        print(
            f"  {time.perf_counter() - start:6.0f} s: {chats} chats, {docs} docs finished, {failed} failed", flush=True
        )


def _client(n: int, timeout: float) -> Any:
    import httpx

    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout, connect=min(60.0, timeout)), trust_env=False)


def _config(base_url: str, model: str, args: argparse.Namespace) -> Any:
    from kvflow.bench.serve_client import ServeConfig

    return ServeConfig(
        base_url=base_url,
        endpoint="completions",
        model=model,
        ignore_eos=True,
        temperature=0.0,
        request_timeout=args.request_timeout,
        disable_tqdm=True,
    )


async def run_load(base_url: str, model: str, w: Workload, args: argparse.Namespace, tokenizer: Any) -> LoadRun:
    """The timed run: chat clients until --duration-s, documents on their arrivals, then the drain."""
    cfg = _config(base_url, model, args)
    records: list[Any] = []
    async with _client(w.chat_users + len(w.docs) + 4, args.request_timeout) as client:
        start = time.perf_counter()
        deadline = start + args.duration_s
        tasks = [
            asyncio.create_task(_chat_user(client, cfg, w, u, deadline, model, tokenizer, records))
            for u in range(w.chat_users)
        ]
        tasks += [
            asyncio.create_task(_doc(client, cfg, i, d, start, model, tokenizer, records)) for i, d in enumerate(w.docs)
        ]
        ticker = asyncio.create_task(_progress(records, start))
        try:
            _, pending = await asyncio.wait(tasks, timeout=args.duration_s + args.drain_timeout_s)
        finally:
            ticker.cancel()
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    for r in records:
        if r.end_time is None and not r.success:
            r.error = r.error or f"unfinished after the {args.drain_timeout_s:g} s drain"
    ends = [r.end_time for r in records if r.end_time is not None]
    return LoadRun(records, (max(ends) if ends else time.perf_counter()) - start)


async def warm_up(base_url: str, model: str, w: Workload, args: argparse.Namespace, tokenizer: Any) -> None:
    """The untimed requests, one after the other; any failure stops the setup."""
    from kvflow.bench.serve_client import new_record, send_request

    cfg = _config(base_url, model, args)
    async with _client(2, args.request_timeout) as client:
        for i, req in enumerate(w.warm_up):
            rec = new_record(i, req, math.nan)
            await send_request(client, cfg, req, rec, model, tokenizer)
            if not rec.success:
                raise ServerError(f"the warm-up {req.request_class} request failed: {rec.error}")


def transfer_snapshot(decode_url: str, router_url: str) -> TransferStats:
    stats = transfer_counters(scrape(decode_url))
    router = scrape(router_url)
    stats.prefill_fallbacks = router_fallbacks(router)
    decisions = router_decisions(router)
    if decisions is not None:
        stats.local_prefills, stats.remote_prefills = decisions
    return stats


# ----------------------------------------------------------------------------------------------
# One setup
# ----------------------------------------------------------------------------------------------


@dataclass
class SetupResult:
    setup: str
    pinned: bool
    summary: LoadSummary
    records: list[Any]
    transfer: TransferStats | None = None
    doc_transfer: DocTransfer | None = None

    def to_dict(self) -> dict:
        recs = []
        for r in self.records:
            d = r.to_dict()
            d.pop("generated_text", None)
            recs.append(d)
        return {
            "setup": self.setup,
            "label": SETUP_LABELS[self.setup],
            "pinned": self.pinned,
            "summary": asdict(self.summary),
            "transfer": self.transfer.to_dict() if self.transfer is not None else None,
            "doc_transfer": asdict(self.doc_transfer) if self.doc_transfer is not None else None,
            "requests": recs,
        }


def run_setup(
    setup: str, w: Workload, args: argparse.Namespace, tokenizer: Any, log_dir: str, cpus: Sequence[int] | None
) -> SetupResult:
    specs = setup_specs(setup, args, cpus)
    print(f"\n=== {SETUP_LABELS[setup]} ===", flush=True)
    with running(specs, log_dir, args) as procs:
        url = specs[-1].url
        model, max_len = served_model(url), server_max_model_len(url, timeout=30.0)
        need = w.longest_request() + 1  # +1: a BOS the server may add
        if max_len is not None and need > max_len:
            raise ServerError(
                f"the longest request needs {need} tokens but max_model_len is {max_len}: lower "
                "--doc-max-len / the output lengths, or serve a longer --max-model-len"
            )
        asyncio.run(warm_up(url, model, w, args, tokenizer))
        before = transfer_snapshot(specs[1].url, url) if setup in PD_SETUPS else None
        print(f"timed run: {args.duration_s:g} s, {w.chat_users} chat clients, {len(w.docs)} documents", flush=True)
        run = asyncio.run(run_load(url, model, w, args, tokenizer))
        for p in procs:
            p.check_alive()
        result = SetupResult(setup, cpus is not None, summarize_load(run.records, run.duration_s), run.records)
        if before is not None:
            time.sleep(0.5)  # the engine publishes its counters between steps
            result.transfer = transfer_delta(before, transfer_snapshot(specs[1].url, url))
            block_size = int(flag_value(args.server_flags, "--block-size") or DEFAULT_BLOCK_SIZE)
            # pd_cond: prompts short enough for the decode engine moved no KV (about: the router
            # estimates their lengths)
            moved = [r for r in run.records if setup == "pd" or r.prompt_len > args.max_local_prefill_length]
            result.doc_transfer = doc_transfer(result.transfer, moved, result.summary.doc_ttft_s_mean, block_size)
    return result


# ----------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------


def _ms(x: float | None) -> float | None:
    return None if x is None else 1e3 * x


def setup_report(r: SetupResult) -> str:
    from kvflow.bench.report import setup_block

    s = r.summary
    pairs: list[tuple[str, Any]] = [
        ("chats finished / failed", f"{s.chats_finished} / {s.chats_failed}"),
        ("chat ITL p50 / p99 (ms)", f"{_f(s.chat_itl_ms_p50)} / {_f(s.chat_itl_ms_p99)}"),
        ("chat TPOT p50 / p99 (ms)", f"{_f(s.chat_tpot_ms_p50)} / {_f(s.chat_tpot_ms_p99)}"),
        ("docs finished / failed", f"{s.docs_finished} / {s.docs_failed}"),
        ("doc TTFT p50 / p99 / mean (s)", f"{_f(s.doc_ttft_s_p50)} / {_f(s.doc_ttft_s_p99)} / {_f(s.doc_ttft_s_mean)}"),
        ("output tokens", s.output_tokens),
        ("duration (s)", s.duration_s),
        ("output throughput (tok/s)", s.output_throughput),
    ]
    t, d = r.transfer, r.doc_transfer
    if t is not None:
        failures = ", ".join(f"{k} {v:g}" for k, v in t.failures.items() if v) or "none"
        pairs += [
            ("KV bytes received", f"{t.bytes_received:,.0f} ({t.bytes_received / 1e6:,.1f} MB)"),
            ("KV blocks received", f"{t.blocks_received:,.0f}"),
            ("KV fetches", f"{t.fetches:,.0f}"),
            ("KV transfer seconds (total)", t.seconds),
            ("KV transfer GB/s", _f(t.gb_per_s, 3)),
            ("KV mean fetch (ms)", _f(_ms(t.mean_fetch_s))),
            ("KV failures", failures),
            ("router prefill fallbacks", "-" if t.prefill_fallbacks is None else f"{t.prefill_fallbacks:g}"),
        ]
        if t.local_prefills is not None and r.setup == "pd_cond":
            pairs.append(
                ("router prefills on decode / on prefill", f"{t.local_prefills:g} / {t.remote_prefills or 0.0:g}")
            )
    if d is not None:
        pairs += [
            ("doc share of moved blocks (%)", _f(percent(d.block_share), 1)),
            (
                "KV transfer per doc (ms)",
                f"{_f(_ms(d.per_doc_s_low))} - {_f(_ms(d.per_doc_s_high))} (mean fetch - by blocks)",
            ),
            (
                "  share of doc mean TTFT (%)",
                f"{_f(percent(d.share_of_ttft_low), 1)} - {_f(percent(d.share_of_ttft_high), 1)}",
            ),
        ]
    pin = "" if r.pinned else " (NOT pinned: taskset missing or < 2 CPUs)"
    return setup_block(pairs, f"{SETUP_LABELS[r.setup]}{pin}", r.records)


def comparison_table(results: dict[str, SetupResult]) -> str | None:
    from kvflow.bench.report import format_table

    pds = [s for s in PD_SETUPS if s in results]
    if "agg" not in results or not pds:
        return None
    labels = [SETUP_LABELS[s] for s in pds]
    return format_table(
        ["", "aggregated", *labels, *(f"{x} / agg" for x in labels)],
        comparison_rows(results["agg"].summary, *(results[s].summary for s in pds)),
        digits=2,
        title="1P1D (one core each) vs aggregated (two cores, chunked prefill)",
    )


def write_json(path: str, args: argparse.Namespace, results: dict[str, SetupResult], cpu: str, pinning: str) -> None:
    from kvflow.bench.report import dump_json

    conf = {k: v for k, v in vars(args).items() if k != "server_flags"}
    comparison = None
    pds = [s for s in PD_SETUPS if s in results]
    if "agg" in results and pds:
        comparison = {}
        rows = comparison_rows(results["agg"].summary, *(results[s].summary for s in pds))
        for (_, key), row in zip(COMPARED, rows):
            entry = {"aggregated": row[1]}
            for i, s in enumerate(pds):
                # pd keeps the keys of earlier result files ("1P1D", "ratio")
                entry[SETUP_LABELS[s]] = row[2 + i]
                entry["ratio" if s == "pd" else f"ratio_{s}"] = row[2 + len(pds) + i]
            comparison[key] = entry
    dump_json(
        path,
        conf,
        [r.to_dict() for r in results.values()],
        extra={"cpu": cpu, "pinning": pinning, "comparison": comparison},
    )
    print(f"wrote {path}")


def report(results: dict[str, SetupResult], args: argparse.Namespace, cpu: str, pinning: str) -> None:
    for r in results.values():
        print()
        print(setup_report(r))
    table = comparison_table(results)
    print()
    print(cpu)
    print(pinning)
    if table:
        print(table)
    if args.result_json:
        write_json(args.result_json, args, results, cpu, pinning)


# ----------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, exit_on_sigterm)  # unwinds through running(), which stops the servers
    cpu = cpu_line()
    cpus = pinning_cpus()
    pinning = (
        f"pinning: agg taskset -c {cpus[0]},{cpus[1]} (2 threads); pd, pd_cond prefill -c {cpus[0]}, "
        f"decode -c {cpus[1]} (1 thread each); router and client unpinned"
        if cpus is not None
        else "pinning: NONE (taskset missing or fewer than 2 usable CPUs): servers run unpinned"
    )
    print(cpu)
    print(pinning)
    log_dir = tempfile.mkdtemp(prefix="pd_disagg-")
    print(f"server logs: {log_dir}")
    try:
        tokenizer = harness_tokenizer(args.tokenizer, args.server_flags, required=True)
        w = build_workload(args, tokenizer)
    except ValueError as e:
        print(f"pd_disagg: error: {e}", file=sys.stderr)
        return 2
    print(
        f"workload: {args.chat_users} chat clients ({args.chat_prompt_len} -> {args.chat_output_len} tokens), "
        f"{len(w.docs)} documents in {args.duration_s:g} s ([{args.doc_min_len}, {args.doc_max_len}] -> "
        f"{args.doc_output_len} tokens), seed {args.seed}"
    )
    results: dict[str, SetupResult] = {}
    try:
        for setup in args.setups:
            results[setup] = run_setup(setup, w, args, tokenizer, log_dir, cpus)
    except ServerError as e:
        print(f"pd_disagg: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # the servers are already stopped (running())
        print("pd_disagg: interrupted", file=sys.stderr)
        return 130
    finally:
        if results:
            report(results, args, cpu, pinning)
    return 0


if __name__ == "__main__":
    sys.exit(main())
