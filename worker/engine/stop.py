"""When a request stops: max_tokens, the end-of-sequence token and stop token ids.

Stop strings are the router's (it detokenizes; see `kvrail.router.text.detokenizer`), which
cancels a request whose text reached one. Before `min_tokens` the sampler cannot pick the
end-of-sequence token or a stop token id at all; they are checked here only from then on.
"""

from __future__ import annotations

from kvrail.worker.engine.request import Request, RequestStatus


class StopChecker:
    """Decides, after a token was appended, whether the request is finished."""

    def __init__(self, eos_token_id: int | None) -> None:
        self.eos_token_id = eos_token_id

    def check(self, request: Request) -> RequestStatus | None:
        """The finished status the request reached with its last token, or None. Sets
        `request.stop_reason` to the matched token id."""
        params = request.sampling_params
        num_output = request.num_output_tokens
        if num_output >= params.min_tokens:
            last = request.output_token_ids[-1]
            is_eos = not params.ignore_eos and last == self.eos_token_id
            if is_eos or last in params.stop_token_ids:
                request.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
        if num_output >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None
