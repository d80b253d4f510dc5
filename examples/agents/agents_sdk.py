"""The OpenAI Agents SDK against kvrail: an agent with one function tool runs to its end, through
the SDK's default model (the Responses API, `POST /v1/responses`) and through its
chat-completions model.

    make run      # in another terminal: the local stack on http://127.0.0.1:8000/v1
    OPENAI_BASE_URL=http://127.0.0.1:8000/v1 OPENAI_API_KEY=unused \\
        .venv/bin/python examples/agents/agents_sdk.py

Tracing is off and the client is given explicitly, so nothing goes to api.openai.com. SmolLM2-135M,
the default model, calls no tool unasked: the agent forces one call (`tool_choice="required"`,
one call at a time) and stops at it (`stop_on_first_tool`: the tool's result is the run's output).
With a model trained for tools, leave those to the model.
"""

from __future__ import annotations

import asyncio

from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from openai import AsyncOpenAI

MODEL = "SmolLM2-135M-Instruct"


@function_tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"It is sunny in {city}."


async def main() -> None:
    set_tracing_disabled(True)
    client = AsyncOpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY from the environment
    for name, model in (
        ("responses", OpenAIResponsesModel(MODEL, client)),
        ("chat_completions", OpenAIChatCompletionsModel(MODEL, client)),
    ):
        agent = Agent(
            name="weather", instructions="Answer with the weather tool.", tools=[get_weather],
            model=model, tool_use_behavior="stop_on_first_tool",
            model_settings=ModelSettings(
                tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=64
            ),
        )  # fmt: skip
        result = await Runner.run(agent, "What is the weather in Paris?", max_turns=2)
        calls = [i.raw_item for i in result.new_items if i.type == "tool_call_item"]
        print(f"{name}: {len(result.raw_responses)} model call(s), {len(calls)} tool call(s); "
              f"output {result.final_output!r}")  # fmt: skip


if __name__ == "__main__":
    asyncio.run(main())
