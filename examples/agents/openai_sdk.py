"""The `openai` SDK against kvrail: a structured output parsed into a pydantic model, and a tool
round trip (the model calls a function, the answer comes back as a `role: tool` message, the
model answers from it).

    make run      # in another terminal: the local stack on http://127.0.0.1:8000/v1
    OPENAI_BASE_URL=http://127.0.0.1:8000/v1 OPENAI_API_KEY=unused \\
        .venv/bin/python examples/agents/openai_sdk.py

SmolLM2-135M, the default model, has no tool format of its own and rarely calls a tool unasked:
`tool_choice="required"` makes kvrail's grammar force a call whose arguments validate against the
function's schema. With a model trained for tools, `auto` lets it choose.
"""

from __future__ import annotations

import json

from openai import OpenAI
from pydantic import BaseModel, Field

MODEL = "SmolLM2-135M-Instruct"


class City(BaseModel):
    # Bounds keep a small model's answer short: the grammar ends each string by the limit.
    name: str = Field(max_length=40)
    country: str = Field(max_length=40)
    population_millions: int = Field(ge=0, le=1000)


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 40},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}


def get_weather(city: str, unit: str) -> dict[str, object]:
    return {"city": city, "temperature": 21 if unit == "celsius" else 70, "unit": unit}


def main() -> None:
    client = OpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY from the environment

    # 1. A structured output: the reply is JSON that validates against City's schema.
    parsed = client.chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe Paris as JSON."}],
        response_format=City,
        max_completion_tokens=200,
        temperature=0,
    )
    city = parsed.choices[0].message.parsed
    print("parsed:", type(city).__name__, city.model_dump_json() if city else None)

    # 2. A tool round trip.
    messages: list[dict[str, object]] = [
        {"role": "user", "content": "What is the weather in Paris, in celsius?"}
    ]
    first = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER_TOOL], tool_choice="required",
        max_completion_tokens=200, temperature=0,
    )  # fmt: skip
    choice = first.choices[0]
    call = choice.message.tool_calls[0]
    arguments = json.loads(call.function.arguments)
    print("tool call:", choice.finish_reason, call.function.name, json.dumps(arguments))
    messages.append(choice.message.model_dump(exclude_none=True))
    result = get_weather(**arguments)
    messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)})
    answer = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER_TOOL], max_completion_tokens=40,
        temperature=0,
    )  # fmt: skip
    print("answer:", answer.choices[0].finish_reason, repr(answer.choices[0].message.content))


if __name__ == "__main__":
    main()
