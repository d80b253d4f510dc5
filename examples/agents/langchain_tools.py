"""LangChain (`langchain-openai`) against kvrail: `with_structured_output` (a JSON schema the
reply must satisfy) and `bind_tools` (a forced tool call whose arguments validate).

    make run      # in another terminal: the local stack on http://127.0.0.1:8000/v1
    OPENAI_BASE_URL=http://127.0.0.1:8000/v1 OPENAI_API_KEY=unused \\
        .venv/bin/python examples/agents/langchain_tools.py

`tool_choice="any"` is LangChain's word for OpenAI's `required` (kvrail's grammar forces a call);
SmolLM2-135M, the default model, would rarely call a tool unasked.
"""

from __future__ import annotations

import json

from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

MODEL = "SmolLM2-135M-Instruct"


class Answer(BaseModel):
    """A short answer and how sure the model is of it."""

    answer: str = Field(max_length=80)
    confidence: int = Field(ge=0, le=10)


@tool
def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


def main() -> None:
    llm = ChatOpenAI(model=MODEL, temperature=0, max_completion_tokens=200)

    structured = llm.with_structured_output(Answer)  # response_format: json_schema, strict
    result = structured.invoke("What is the capital of France?")
    print("structured:", type(result).__name__, result.model_dump_json())

    with_tools = llm.bind_tools([multiply], tool_choice="any")
    message = with_tools.invoke("What is 6 times 7?")
    call = message.tool_calls[0]
    print("tool call:", call["name"], json.dumps(call["args"]), "->", multiply.invoke(call["args"]))


if __name__ == "__main__":
    main()
