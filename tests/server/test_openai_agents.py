"""openai-agents against kvflow: an Agent with a structured `output_type` and a function tool runs to
its final output, over the Responses API (the SDK's default model) and over Chat Completions. Every
turn sends `text.format` / `response_format` together with `tools` (once a 400). The first turn is
forced to call the tool (tool_choice "required"), the second to answer (tool_choice "none", set by a
hook once the tool has run), so what the tiny random model would choose does not decide the run: it
checks the protocol (the call, its output sent back as input, the schema's answer parsed)."""

from __future__ import annotations

import dataclasses
from typing import Literal

import agents  # openai-agents (a test requirement: never skipped)
import pytest
from pydantic import BaseModel, Field

from kvflow.config import EngineConfig

from server_utils import LiveServer

pytestmark = pytest.mark.server


class Forecast(BaseModel):  # bounded fields: a random model could otherwise write to its token limit
    city: Literal["Paris", "Rome"]
    degrees: int = Field(ge=-50, le=50)


@pytest.fixture(scope="module")
def server(model_factory):
    path, _ = model_factory("llama", max_position_embeddings=4096)  # room for the tools and two turns
    s = LiveServer(EngineConfig(model=path, num_kv_blocks=2048))
    yield s
    s.stop()


@pytest.mark.parametrize("api", ["responses", "chat_completions"])
def test_agent_with_output_type_and_a_tool(server, api):
    agents.set_tracing_disabled(True)  # nothing goes to OpenAI's tracing endpoint
    calls: list[str] = []

    @agents.function_tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """The weather in a city."""
        calls.append(city)
        return "18 degrees, sunny"

    class AnswerAfterTheTool(agents.RunHooks):
        async def on_tool_end(self, context, agent, tool, result) -> None:
            agent.model_settings = dataclasses.replace(agent.model_settings, tool_choice="none")

    client = server.async_openai(timeout=120)
    model_class = agents.OpenAIResponsesModel if api == "responses" else agents.OpenAIChatCompletionsModel
    agent = agents.Agent(
        name="forecaster",
        instructions="Answer with a forecast.",
        tools=[get_weather],
        output_type=Forecast,
        model=model_class(model=server.model, openai_client=client),
        model_settings=agents.ModelSettings(
            tool_choice="required", parallel_tool_calls=False, max_tokens=1000, extra_body={"seed": 0}
        ),
        reset_tool_choice=False,
    )
    result = agents.Runner.run_sync(agent, "What is the weather in Paris?", max_turns=4, hooks=AnswerAfterTheTool())
    assert isinstance(result.final_output, Forecast)
    assert len(calls) == 1  # the forced first turn ran the tool; its result went back to the model
    kinds = [item.type for item in result.new_items]
    assert kinds == ["tool_call_item", "tool_call_output_item", "message_output_item"], kinds
    server.wait_engine_idle()
