"""When a request stops: max_tokens, EOS, stop token ids and stop strings."""

from __future__ import annotations

from collections.abc import Callable

from kvrail.worker.engine.request import Request, RequestStatus

Detokenize = Callable[[list[int]], str]


class StopChecker:
    """Decides, after a token was appended, whether the request is finished.

    Stop strings need `detokenize`; the engine rejects a request with stop strings when it has
    none. A stop string is searched only in the text the newest token could have completed, so the
    cost per step is bounded by the longest stop string, not by the output length.
    """

    def __init__(self, eos_token_id: int | None, detokenize: Detokenize | None = None) -> None:
        self.eos_token_id = eos_token_id
        self.detokenize = detokenize

    def check(self, request: Request) -> RequestStatus | None:
        """The finished status the request reached with its last token, or None. Sets
        `request.stop_reason` to the matched stop token id or stop string."""
        params = request.sampling_params
        last = request.output_token_ids[-1]
        if not params.ignore_eos and last == self.eos_token_id:
            request.stop_reason = last
            return RequestStatus.FINISHED_STOPPED
        if last in params.stop_token_ids:
            request.stop_reason = last
            return RequestStatus.FINISHED_STOPPED
        if params.stop:
            matched = self._stop_string(request)
            if matched is not None:
                request.stop_reason = matched
                return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _stop_string(self, request: Request) -> str | None:
        if self.detokenize is None:
            raise RuntimeError("stop strings need a tokenizer; the engine checks this at admission")
        outputs = request.output_token_ids
        # A token decodes to at least one character in practice, so the text that can contain a
        # newly completed stop string lies within the last len(stop) + 1 tokens.
        window = max(len(s) for s in request.sampling_params.stop) + 1
        before = self.detokenize(outputs[-window - 1 : -1]) if len(outputs) > 1 else ""
        text = self.detokenize(outputs[-window - 1 :])
        # Only a match that ends in the newly added text counts; earlier ones were checked before.
        # (`before` is a prefix of `text` for the tokenizers we serve; fall back to a full search.)
        offset = len(before) if text.startswith(before) else 0
        for stop in request.sampling_params.stop:
            index = text.find(stop, max(offset - len(stop) + 1, 0))
            if index != -1:
                return stop
        return None
