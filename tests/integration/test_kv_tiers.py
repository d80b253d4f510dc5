"""The host KV tier in the whole local stack (`kvrail up`: router, a prefill worker and a decode
worker running SmolLM2, NIXL between them), driven by the real `openai` client.

Three multi-turn conversations whose prefixes outgrow each worker's GPU pool are served twice,
without tiers and with the host tier, and answer the same, word for word (greedy); with the tier
the later turns' prefixes are served from host memory instead of computed again, whether the
prompt is prefilled by the decode worker itself (short) or by the prefill worker, whose KV then
moves to the decode worker over NIXL (long, past `min_remote_prefill_tokens`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from openai import OpenAI

from kvrail.testing.up import kvrail_up

POOL = {"KVRAIL_NUM_KV_BLOCKS": "40", "KVRAIL_MIN_REMOTE_PREFILL_TOKENS": "400"}
"""39 blocks of 16 tokens per worker: a third of what the conversations' last prompts hold."""
HOST_TIER = {"KVRAIL_KV_HOST_TIER_BYTES": str(256 << 20)}
TOPICS = ("harbour cranes", "alpine glaciers", "printing presses")


def _user_turn(topic: str, turn: int) -> str:
    notes = " ".join(f"Note {turn}.{i}: the {topic} log lists item {i * 7 + turn}."
                     for i in range(9))  # fmt: skip
    return f"{notes} In a few words, what is item {turn * 7} about?"


def _converse(root: str) -> tuple[list[str], list[int], list[int]]:
    """Each conversation's turns in round robin (the others evict its prefix between its
    turns): every answer, and each turn's prompt and cached prompt tokens."""
    client = OpenAI(base_url=f"{root}/v1", api_key="unused", max_retries=0, timeout=300)
    histories: list[list[Any]] = [
        [{"role": "system", "content": f"You answer questions about {topic}. " * 12}]
        for topic in TOPICS
    ]
    answers, prompts, cached = [], [], []
    for turn in range(3):
        for topic, history in zip(TOPICS, histories, strict=True):
            history.append({"role": "user", "content": _user_turn(topic, turn)})
            reply = client.chat.completions.create(
                model="SmolLM2-135M-Instruct", messages=history, max_tokens=8, temperature=0
            )
            text = reply.choices[0].message.content or ""
            history.append({"role": "assistant", "content": text})
            answers.append(text)
            usage = reply.usage
            assert usage is not None and usage.prompt_tokens_details is not None
            prompts.append(usage.prompt_tokens)
            cached.append(usage.prompt_tokens_details.cached_tokens or 0)
    return answers, prompts, cached


def test_conversations_larger_than_the_gpu_pools_are_served_from_the_host_tier(
    tmp_path: Path,
) -> None:
    with kvrail_up(tmp_path / "plain", POOL) as root:
        plain_answers, prompts, plain_cached = _converse(root)
    with kvrail_up(tmp_path / "tiers", {**POOL, **HOST_TIER}) as root:
        answers, tier_prompts, cached = _converse(root)
    assert tier_prompts == prompts
    assert sum(prompts[-len(TOPICS) :]) > 2 * 39 * 16  # live prefixes: twice a worker's pool
    assert min(prompts) < 400 < max(prompts)  # local and remote prefills both
    assert answers == plain_answers
    later = slice(len(TOPICS), None)  # turns 2 and 3: their prefixes were served before
    assert sum(cached[later]) > sum(plain_cached[later]) + 600
    # every later turn finds at least its conversation's system prompt and first question
    assert all(c >= 150 for c in cached[later]), (cached, prompts, plain_cached)
