"""The agents' examples (examples/agents/) run as written against `kvrail up`, each with its
real client: the `openai` SDK (a structured output parsed into a pydantic model, a forced tool
call and its round trip), LangChain (`with_structured_output`, `bind_tools`) and the OpenAI
Agents SDK (an agent with one tool, through the Responses API and through chat completions).

Each example is a script a user runs with `OPENAI_BASE_URL` pointing at the local stack; it
prints what it got, one labelled line per step, and this test reads those lines back and checks
them: the parsed object is of the model's class and validates, the tool call names the function
with arguments that satisfy its schema, the round trip ends with an answer.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvrail.testing import up

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "agents"


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with up.kvrail_up(tmp_path_factory.mktemp("agents-up")) as root:
        yield f"{root}/v1"


def _run(example: str, base_url: str) -> dict[str, str]:
    """Run an example to completion; its output lines as label -> the rest of the line."""
    env = {**os.environ, "OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": "unused"}
    done = subprocess.run([sys.executable, "-P", str(EXAMPLES / example)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, f"{example} failed:\n{done.stderr[-6000:]}"
    lines = [line.partition(": ") for line in done.stdout.splitlines() if ": " in line]
    return {label: rest for label, _, rest in lines}


def test_the_openai_sdk_example_parses_a_structured_output_and_completes_a_tool_round_trip(
    base_url: str,
) -> None:
    out = _run("openai_sdk.py", base_url)
    kind, _, body = out["parsed"].partition(" ")
    assert kind == "City"
    city = json.loads(body)
    assert len(city["name"]) <= 40 and len(city["country"]) <= 40
    assert type(city["population_millions"]) is int and 0 <= city["population_millions"] <= 1000
    finish, name, arguments = out["tool call"].split(" ", 2)
    assert (finish, name) == ("tool_calls", "get_weather")
    args = json.loads(arguments)
    assert set(args) == {"city", "unit"} and args["unit"] in ("celsius", "fahrenheit")
    assert out["answer"].split(" ", 1)[0] in ("stop", "length")


def test_the_langchain_example_gets_a_structured_output_and_a_forced_tool_call(
    base_url: str,
) -> None:
    out = _run("langchain_tools.py", base_url)
    kind, _, body = out["structured"].partition(" ")
    assert kind == "Answer"
    answer = json.loads(body)
    assert len(answer["answer"]) <= 80 and 0 <= answer["confidence"] <= 10
    name, _, rest = out["tool call"].partition(" ")
    arguments, _, product = rest.rpartition(" -> ")
    args = json.loads(arguments)
    assert name == "multiply" and set(args) == {"a", "b"}
    assert all(type(v) is int for v in args.values()) and int(product) == args["a"] * args["b"]


def test_the_agents_sdk_example_runs_an_agent_through_responses_and_chat_completions(
    base_url: str,
) -> None:
    out = _run("agents_sdk.py", base_url)
    for api in ("responses", "chat_completions"):
        counts, _, output = out[api].partition("; output ")
        assert counts == "1 model call(s), 1 tool call(s)"
        assert output.startswith("'It is sunny in ") and output.endswith(".'")
