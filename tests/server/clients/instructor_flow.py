"""Run by tests/server/test_instructor.py in .venv-clients (instructor's own pins): instructor's
flows against a kvflow server, printed as one JSON object for the test to check.

argv: base URL (".../v1"), served model name."""

from __future__ import annotations

import json
import sys
from typing import Literal

import instructor
import openai
from pydantic import BaseModel, Field


class Forecast(BaseModel):
    city: str = Field(max_length=8)
    unit: Literal["celsius", "fahrenheit"]
    days: int = Field(ge=0, le=9)


def main() -> None:
    url, model = sys.argv[1], sys.argv[2]
    base = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=60)
    args = dict(
        model=model,
        response_model=Forecast,
        messages=[{"role": "user", "content": "The forecast for Paris, please."}],
        max_tokens=600,  # the random model spends tokens on the whitespace JSON allows
        temperature=0,
        max_retries=0,  # a protocol failure must show, not be retried away
    )
    out: dict = {"versions": {"instructor": instructor.__version__, "openai": openai.__version__}}
    tools = instructor.from_openai(base, mode=instructor.Mode.TOOLS)  # a named tool_choice
    out["tools"] = tools.chat.completions.create(**args).model_dump()
    out["partials"] = [p.model_dump() for p in tools.chat.completions.create_partial(**args)]
    schema = instructor.from_openai(base, mode=instructor.Mode.JSON_SCHEMA)  # response_format json_schema
    out["json_schema"] = schema.chat.completions.create(**args).model_dump()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
