"""The exception hierarchy every component raises from.

The router turns these into OpenAI error bodies in one place (`kvrail.router.openai`); the operator
turns `InvalidSpecError` into a Degraded condition. Lack of capacity is not an error: allocators
return None with no partial effect.
"""


class KvrailError(Exception):
    """Base class of every error kvrail raises on purpose."""


class ConfigError(KvrailError):
    """Settings or a configuration file are invalid. The message names the field and the value."""


class InvalidRequestError(KvrailError):
    """A client request is malformed or exceeds a limit (HTTP 400)."""


class ModelNotFoundError(KvrailError):
    """A model source cannot be resolved to weights on this machine."""


class IncompatibleWorkerError(KvrailError):
    """Two workers disagree on the model fingerprint and must never pair."""


class TransferError(KvrailError):
    """A KV transfer failed or its envelope did not validate."""


class DeadlineExceededError(KvrailError):
    """A request or job ran past its deadline."""


class NotBuiltError(KvrailError):
    """A component exists in the design but is not built yet; raised instead of pretending."""
