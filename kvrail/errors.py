"""The exception hierarchy every component raises from.

The router turns these into OpenAI error bodies in one place (`kvrail.router.api.errors`). An
invalid `InferencePool` is a pydantic validation error in the operator, which sets `Degraded`
and raises Kopf's `PermanentError`. Lack of capacity is not an error: allocators return None with
no partial effect.
"""


class KvrailError(Exception):
    """Base class of every error kvrail raises on purpose."""


class ConfigError(KvrailError):
    """Settings or a configuration file are invalid. The message names the field and the value."""


class InvalidRequestError(KvrailError):
    """A client request is malformed or exceeds a limit (HTTP 400). `param` names the request
    field at fault, when one is."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ModelNotFoundError(KvrailError):
    """A model source cannot be resolved to weights on this machine."""


class TransferError(KvrailError):
    """A KV transfer failed or its envelope did not validate."""


class DeadlineExceededError(KvrailError):
    """A request or job ran past its deadline."""


class RankLostError(KvrailError):
    """A tensor-parallel rank of this worker is gone (its process died or its channel broke).
    The worker cannot run another step: it fails as a whole."""
