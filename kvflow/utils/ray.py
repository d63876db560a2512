"""Ray for the parts of kvflow that place work with it (tensor-parallel ranks, data-parallel
replicas). Ray is optional: it is imported only when a Ray backend is asked for."""

from __future__ import annotations

import os
from typing import Any


def import_ray() -> Any:
    """The `ray` module; ValueError (a usage error) when it is not installed."""
    try:
        import ray
    except ImportError:
        raise ValueError("the ray backends need the ray package (pip install ray)") from None
    return ray


def join_ray() -> bool:
    """Ray for this process: the cluster RAY_ADDRESS names, the one this process already joined, or
    a local one started now. True when started here (the caller shuts it down when done)."""
    ray = import_ray()
    if ray.is_initialized():
        return False
    ray.init(address=os.environ.get("RAY_ADDRESS") or None, include_dashboard=False, log_to_driver=False)
    return True
