"""What a GGUF load derives from the file's metadata, kept so that later loads skip it.

Parsing a GGUF's metadata (the vocabulary and merges are ~100k strings) and building its tokenizer
with transformers took ~1.6 s of a 5 s warm `kvflow serve` start. An entry holds the HF-style
config, the model name, the tokenizer's state (`tokenizer.state_of`) and each tensor's place in
the file (byte offset, numpy dtype and shape, exactly as `GGUFReader` presents it), so a later load
maps the file and slices the tensors without parsing anything; the weights are still read from
the GGUF itself (no second copy of them on disk).

Entries live under `$KVFLOW_CACHE_DIR/models/`, named by the file's real path, size and mtime
(a rewritten or replaced file gets a new name) and stating them inside as well; an entry that does
not parse, is of another format version or names another file is ignored and rewritten. Writes are
atomic (temporary file, then rename), so concurrent starts and crashes leave no torn entry behind.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvflow.cache import cache_root

logger = logging.getLogger(__name__)

# Bump when what an entry holds, or how the loader derives it, changes.
FORMAT_VERSION = 1


@dataclass(frozen=True)
class TensorPlace:
    """One tensor: its HF name, GGML type name, and where its bytes lie in the file."""

    hf_name: str
    qtype: str
    offset: int
    dtype: str  # numpy dtype string of GGUFReader's view of the data (e.g. '<f4', '|u1')
    shape: tuple[int, ...]  # that view's shape (GGUF dims reversed; bytes per row for quantized types)


@dataclass
class GGUFIndex:
    hf_config: dict[str, Any]
    name: str
    tensors: list[TensorPlace]
    tokenizer: dict[str, Any] | None  # tokenizer.state_of(...), None when not built


def _identity(path: str) -> dict[str, Any]:
    st = os.stat(path)
    return {"path": os.path.realpath(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def entry_path(path: str) -> Path:
    ident = _identity(path)
    key = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:24]
    return cache_root() / "models" / f"gguf-{Path(path).stem[:64]}-{key}.json"


def read(path: str) -> GGUFIndex | None:
    """The entry for `path` as it is now, or None (none yet, stale, or unreadable)."""
    try:
        entry = entry_path(path)
        with open(entry, encoding="utf-8") as f:
            data = json.load(f)
        if data.get("version") != FORMAT_VERSION or data.get("source") != _identity(path):
            return None
        tensors = [
            TensorPlace(t["hf_name"], t["qtype"], int(t["offset"]), t["dtype"], tuple(t["shape"]))
            for t in data["tensors"]
        ]
        return GGUFIndex(data["hf_config"], data["name"], tensors, data.get("tokenizer"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:  # torn or foreign: rebuilt by the caller
        logger.info("ignoring the GGUF cache entry for %s (%s: %s); it is rebuilt", path, type(e).__name__, e)
        return None


def write(path: str, index: GGUFIndex) -> None:
    """Store `index` for `path`; a cache that cannot be written only costs the next start time."""
    try:
        entry = entry_path(path)
        data = {
            "version": FORMAT_VERSION,
            "source": _identity(path),
            "hf_config": index.hf_config,
            "name": index.name,
            "tokenizer": index.tokenizer,
            "tensors": [
                {"hf_name": t.hf_name, "qtype": t.qtype, "offset": t.offset, "dtype": t.dtype, "shape": list(t.shape)}
                for t in index.tensors
            ],
        }
        entry.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=entry.parent, prefix=entry.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(data, f)
            os.replace(tmp, entry)
        except BaseException:
            os.unlink(tmp)
            raise
    except (OSError, TypeError, ValueError) as e:
        logger.warning("could not write the GGUF cache entry for %s: %s", path, e)
