"""instructor (the structured-output client library) against a server on a tiny random model: TOOLS
mode (a named tool_choice) gives the model object, its partial stream grows field by field into the
whole object, and JSON_SCHEMA mode (response_format) validates. instructor pins an older openai than
the main environment's, so it runs from `.venv-clients` (made by `make setup`) in a subprocess."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from kvflow.config import EngineConfig

from server_utils import LiveServer

pytestmark = pytest.mark.server

ROOT = Path(__file__).resolve().parents[2]
CLIENTS_PYTHON = ROOT / ".venv-clients" / "bin" / "python"
FLOW = Path(__file__).parent / "clients" / "instructor_flow.py"


@pytest.fixture(scope="module")
def server(model_factory):
    path, _ = model_factory("llama", max_position_embeddings=2048)  # room for the tool's system prompt
    s = LiveServer(EngineConfig(model=path, num_kv_blocks=512))
    yield s
    s.stop()


def test_instructor_flows(server):
    assert CLIENTS_PYTHON.exists(), f"{CLIENTS_PYTHON} is missing: run `make setup`"
    run = subprocess.run(
        [str(CLIENTS_PYTHON), str(FLOW), server.url + "/v1", server.model],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    print(out["versions"])
    final = out["tools"]
    # The grammar keeps the tiny model inside the schema; instructor validated it into the model.
    assert len(final["city"]) <= 8 and final["unit"] in ("celsius", "fahrenheit") and 0 <= final["days"] <= 9
    partials = out["partials"]
    # Streamed: many partials, each no less complete than the one before, the last one a whole
    # Forecast. (Not the object above: instructor's partial mode sends a schema of optional fields,
    # so the prompt, and the random model's tokens, differ.)
    assert len(partials) > 1
    filled = [sum(v is not None for v in p.values()) for p in partials]
    assert filled == sorted(filled) and filled[0] < filled[-1] == len(final)
    last = partials[-1]
    assert len(last["city"]) <= 8 and last["unit"] in ("celsius", "fahrenheit") and 0 <= last["days"] <= 9
    s = out["json_schema"]
    assert len(s["city"]) <= 8 and s["unit"] in ("celsius", "fahrenheit") and 0 <= s["days"] <= 9
