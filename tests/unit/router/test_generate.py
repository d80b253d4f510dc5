"""What `generate` does to a record before it renders it: a stop string ends the logprobs at
the token that completed it."""

from __future__ import annotations

from kvrail.outputs import RequestOutput, TokenLogprobs
from kvrail.router.generate import _feed_to_stop
from kvrail.router.text.detokenizer import Detokenizer

TEXTS = {1: "Hello", 2: " ST", 3: "OP", 4: " more", 5: " text"}


def detokenizer(stop: tuple[str, ...] = ("STOP",)) -> Detokenizer:
    return Detokenizer(lambda ids: "".join(TEXTS[i] for i in ids), [], stop)


def output(*token_ids: int) -> RequestOutput:
    logprobs = tuple(TokenLogprobs(t, -float(t)) for t in token_ids)
    return RequestOutput("r", token_ids, logprobs=logprobs)


def test_a_stop_string_keeps_the_logprobs_up_to_the_token_that_completed_it() -> None:
    detok = detokenizer()
    text, cut = _feed_to_stop(detok, output(1, 2, 3, 4, 5))
    assert (text, detok.stopped) == ("Hello ", True)
    assert cut.token_ids == (1, 2, 3)
    assert [lp.token_id for lp in cut.logprobs] == [1, 2, 3]


def test_without_a_stop_every_token_keeps_its_logprobs_and_the_text_is_the_same() -> None:
    whole = output(1, 4, 5)
    detok = detokenizer()
    text, same = _feed_to_stop(detok, whole)
    assert same is whole and not detok.stopped
    assert text + detok.flush() == "Hello more text"
    assert detokenizer().feed_each((1, 2, 3, 4)) == ("Hello ", 3)
    assert detokenizer().feed_each((1, 4)) == ("Hello more", 2)
