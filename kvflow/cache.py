"""Where kvflow keeps what it derives once per machine or file: `$KVFLOW_CACHE_DIR`, else
`~/.cache/kvflow` (compiled kernels and the autotune's choices under kernels/, prepared model
files under models/)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("KVFLOW_CACHE_DIR") or Path.home() / ".cache" / "kvflow")
