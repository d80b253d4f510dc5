"""From a request body to the one `SamplingParams` it travels with (`kvrail.sampling`).

An omitted field takes its request default: the model's generation config where it says one
(`generation_config: model`, the default, as vLLM does), else OpenAI's. The defaults are decided
here and nowhere else; `max_tokens` is resolved by the app, which knows the context left.
Besides the sampling itself, a request asks the router for stop strings and how to stream
(`Delivery`); those never leave the router.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from kvrail.errors import InvalidRequestError
from kvrail.router.api.schemas import ChatCompletionRequest, CompletionRequest
from kvrail.sampling import SamplingParams, TokenBias

GenerationConfig = Literal["model", "openai"]


@dataclass(frozen=True, slots=True)
class Defaults:
    """What an omitted field means; `source` says where the values came from."""

    temperature: float = 1.0  # OpenAI's
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    source: str = "openai"

    @classmethod
    def of(cls, mode: GenerationConfig, model_config: Mapping[str, float]) -> Defaults:
        """The defaults of `mode`: `model` takes the model's generation config (`GENERATION_KEYS`
        of `kvrail.model_files`) over OpenAI's values; `openai` ignores it."""
        if mode == "openai" or not model_config:
            return cls()
        base = cls()
        return cls(
            temperature=model_config.get("temperature", base.temperature),
            top_p=model_config.get("top_p", base.top_p),
            top_k=int(model_config.get("top_k", base.top_k)),
            min_p=model_config.get("min_p", base.min_p),
            repetition_penalty=model_config.get("repetition_penalty", base.repetition_penalty),
            source="model",
        )

    def describe(self) -> dict[str, float | int | str]:
        return {
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
            "min_p": self.min_p, "repetition_penalty": self.repetition_penalty,
            "source": self.source,
        }  # fmt: skip


@dataclass(frozen=True, slots=True)
class Delivery:
    """What the router itself does with a request's output."""

    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    continuous_usage_stats: bool = False
    """Usage in every streamed chunk (vLLM's `stream_options.continuous_usage_stats`)."""
    echo: bool = False
    """The prompt leads the returned text (completions' `echo`)."""


@dataclass(frozen=True, slots=True)
class Requested:
    """A request's generation fields as the client sent them (None: omitted)."""

    max_tokens: int | None
    """None: as many as the context leaves."""
    delivery: Delivery
    fields: dict[str, object] = field(default_factory=dict)
    """The sampling fields the client set, by `SamplingParams` name."""
    n: int = 1
    """Choices returned."""
    best_of: int | None = None
    """Choices generated, of which the `n` likeliest are returned (completions); None: `n`."""

    def params(self, max_tokens: int, defaults: Defaults) -> SamplingParams:
        """The request's `SamplingParams` with `max_tokens` resolved. Raises InvalidRequestError
        naming the field (e.g. `min_tokens` above `max_tokens`)."""
        values: dict[str, object] = {
            "temperature": defaults.temperature, "top_p": defaults.top_p,
            "top_k": defaults.top_k, "min_p": defaults.min_p,
            "repetition_penalty": defaults.repetition_penalty,
        }  # fmt: skip
        values.update(self.fields)
        values["max_tokens"] = max_tokens
        try:
            return SamplingParams(**values)  # type: ignore[arg-type]
        except InvalidRequestError as err:
            if err.param == "min_tokens":
                raise InvalidRequestError(
                    f"min_tokens ({values.get('min_tokens')}) exceeds max_tokens ({max_tokens})",
                    "min_tokens",
                ) from err
            raise


def requested(req: ChatCompletionRequest | CompletionRequest) -> Requested:
    """The generation fields of a validated request body."""
    if isinstance(req, ChatCompletionRequest):
        max_tokens = req.max_completion_tokens or req.max_tokens
    else:
        max_tokens = req.max_tokens
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    stream = bool(req.stream)
    options = req.stream_options
    fields: dict[str, object] = {}
    for name in ("temperature", "top_p", "min_p", "seed", "min_tokens", "ignore_eos",
                 "repetition_penalty", "presence_penalty", "frequency_penalty"):  # fmt: skip
        value = getattr(req, name)
        if value is not None:
            fields[name] = value
    if req.top_k is not None:
        fields["top_k"] = max(req.top_k, 0)  # vLLM's -1 and 0 both mean off
    if req.stop_token_ids is not None:
        fields["stop_token_ids"] = tuple(dict.fromkeys(req.stop_token_ids))
    if req.logit_bias:
        fields["logit_bias"] = tuple(
            TokenBias(int(key), float(bias)) for key, bias in sorted(req.logit_bias.items())
        )
    if isinstance(req, ChatCompletionRequest):
        if req.logprobs:
            fields["logprobs"] = req.top_logprobs or 0
    elif req.logprobs is not None:
        fields["logprobs"] = req.logprobs
        if req.echo:
            fields["prompt_logprobs"] = req.logprobs
    delivery = Delivery(
        stop=tuple(dict.fromkeys(stop)),
        stream=stream,
        include_usage=stream and bool(options and options.include_usage),
        continuous_usage_stats=stream and bool(options and options.continuous_usage_stats),
        echo=isinstance(req, CompletionRequest) and bool(req.echo),
    )
    best_of = req.best_of if isinstance(req, CompletionRequest) else None
    return Requested(max_tokens, delivery, fields, req.n or 1, best_of)
