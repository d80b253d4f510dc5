"""Tenants: who may call the router, and how much.

The API keys file (a mounted Secret in a cluster, key `api-keys.yaml`; a local file otherwise)::

    tenants:
      team-a:
        keys: ["sk-team-a-1"]               # plain keys, or
        keySha256: ["9f86d08...", ...]      # their sha256 hex digests (the file then holds no key)
        maxConcurrentRequests: 16           # optional: requests in flight at once
        tokensPerMinute: 200000             # optional: prompt + completion tokens per minute

Without a file every request is accepted as the anonymous tenant. With one, a request without a
valid `Authorization: Bearer <key>` gets 401. Each tenant's name is the salt of its block hashes,
so two tenants never share cached KV (DESIGN.md, block hash).

Limits are enforced here, in the router, per replica: `Admission.admit` reserves one concurrency
slot and `prompt + max_tokens` tokens from the tenant's bucket up front (429 with a Retry-After
when either is short) and `Ticket.release` gives back the slot and the tokens the request did
not use. With R router replicas a tenant can reach R times its limit; a shared limiter would put
NATS or etcd on every request's path, which this trades away on purpose.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvrail.errors import ConfigError

ANONYMOUS = ""
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_FIELDS = {"keys", "keySha256", "maxConcurrentRequests", "tokensPerMinute"}


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    max_concurrent_requests: int | None = None
    tokens_per_minute: int | None = None

    @property
    def salt(self) -> str:
        """Enters the block hash (`kvrail.hashing.root_hash`): tenants never share KV."""
        return self.name


ANONYMOUS_TENANT = Tenant(ANONYMOUS)


class Rejected(Exception):
    """A request the tenant's limits refuse: `status` 401, 400 or 429 with `retry_after_s`."""

    def __init__(self, status: int, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.retry_after_s = retry_after_s


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class TenantTable:
    """API key digests -> tenants. Empty: authentication is off."""

    by_digest: Mapping[str, Tenant] = field(default_factory=dict)

    @property
    def enabled(self) -> bool:
        return bool(self.by_digest)

    def authenticate(self, authorization: str | None) -> Tenant:
        """The tenant of an `Authorization` header value; raises Rejected(401)."""
        if not self.enabled:
            return ANONYMOUS_TENANT
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise Rejected(401, "missing API key: send 'Authorization: Bearer <key>'")
        digest = key_digest(key.strip())
        for known, tenant in self.by_digest.items():
            if hmac.compare_digest(known, digest):
                return tenant
        raise Rejected(401, "invalid API key")

    @classmethod
    def load(cls, path: Path | None) -> TenantTable:
        """Read the API keys file; None: authentication off. Raises ConfigError naming the
        problem (never a key)."""
        if path is None:
            return cls()
        try:
            data = yaml.safe_load(path.read_text())
        except OSError as err:
            raise ConfigError(f"cannot read API keys file {path}: {err.strerror}") from err
        except yaml.YAMLError as err:
            raise ConfigError(f"API keys file {path} is not valid YAML") from err
        return cls.parse(data, str(path))

    @classmethod
    def parse(cls, data: Any, origin: str = "API keys file") -> TenantTable:
        if not isinstance(data, dict) or not isinstance(data.get("tenants"), dict):
            raise ConfigError(f"{origin}: expected a mapping with a 'tenants' mapping")
        by_digest: dict[str, Tenant] = {}
        for name, spec in data["tenants"].items():
            if not isinstance(name, str) or not _NAME.match(name):
                raise ConfigError(f"{origin}: tenant name {name!r} is not a DNS-1123 label")
            if not isinstance(spec, dict):
                raise ConfigError(f"{origin}: tenant {name} must be a mapping")
            unknown = set(spec) - _FIELDS
            if unknown:
                raise ConfigError(f"{origin}: tenant {name}: unknown fields {sorted(unknown)}")
            tenant = Tenant(
                name,
                _limit(spec, "maxConcurrentRequests", name, origin),
                _limit(spec, "tokensPerMinute", name, origin),
            )
            digests = [key_digest(k) for k in _strings(spec, "keys", name, origin)]
            for digest in _strings(spec, "keySha256", name, origin):
                if not _SHA256.match(digest):
                    raise ConfigError(f"{origin}: tenant {name}: keySha256 needs 64 hex digits")
                digests.append(digest)
            if not digests:
                raise ConfigError(f"{origin}: tenant {name} has no keys")
            for digest in digests:
                if digest in by_digest and by_digest[digest].name != name:
                    raise ConfigError(f"{origin}: one key is given to two tenants")
                by_digest[digest] = tenant
        if not by_digest:
            raise ConfigError(f"{origin}: no tenants (leave the file out to turn keys off)")
        return cls(by_digest)


def _strings(spec: dict[str, Any], key: str, name: str, origin: str) -> list[str]:
    values = spec.get(key, [])
    if not isinstance(values, list) or not all(isinstance(v, str) and v for v in values):
        raise ConfigError(f"{origin}: tenant {name}: {key} must be a list of non-empty strings")
    return values


def _limit(spec: dict[str, Any], key: str, name: str, origin: str) -> int | None:
    value = spec.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{origin}: tenant {name}: {key} must be a positive integer")
    return value


@dataclass(slots=True)
class _Usage:
    in_flight: int = 0
    tokens: float = 0.0  # available in the bucket
    refilled_at: float = 0.0


@dataclass(slots=True)
class Ticket:
    """One admitted request's reservation; `release` exactly once (idempotent)."""

    admission: Admission
    tenant: Tenant
    reserved_tokens: int
    released: bool = False

    def release(self, used_tokens: int) -> None:
        if not self.released:
            self.released = True
            self.admission._release(self, used_tokens)


class Admission:
    """Per-tenant concurrency slots and token buckets (capacity = one minute of tokens)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._usage: dict[str, _Usage] = {}

    def admit(self, tenant: Tenant, num_tokens: int) -> Ticket:
        """Reserve a slot and `num_tokens` (prompt + max completion); raises Rejected."""
        usage = self._usage.get(tenant.name)
        if usage is None:
            usage = self._usage[tenant.name] = _Usage(
                tokens=float(tenant.tokens_per_minute or 0), refilled_at=self._clock()
            )
        limit = tenant.max_concurrent_requests
        if limit is not None and usage.in_flight >= limit:
            raise Rejected(429, f"tenant has {limit} requests in flight (its limit)", 1.0)
        rate = tenant.tokens_per_minute
        if rate is not None:
            if num_tokens > rate:
                raise Rejected(
                    400, f"the request needs {num_tokens} tokens (prompt + max_tokens), more "
                    f"than the tenant's {rate} tokens per minute; lower max_tokens",
                )  # fmt: skip
            self._refill(usage, rate)
            if usage.tokens < num_tokens:
                wait_s = (num_tokens - usage.tokens) / (rate / 60.0)
                raise Rejected(429, "tenant's tokens per minute are used up", math.ceil(wait_s))
            usage.tokens -= num_tokens
        usage.in_flight += 1
        return Ticket(self, tenant, num_tokens if rate is not None else 0)

    def in_flight(self, tenant: Tenant) -> int:
        usage = self._usage.get(tenant.name)
        return usage.in_flight if usage else 0

    def _refill(self, usage: _Usage, rate: int) -> None:
        now = self._clock()
        usage.tokens = min(float(rate), usage.tokens + (now - usage.refilled_at) * rate / 60.0)
        usage.refilled_at = now

    def _release(self, ticket: Ticket, used_tokens: int) -> None:
        usage = self._usage[ticket.tenant.name]
        usage.in_flight -= 1
        rate = ticket.tenant.tokens_per_minute
        if rate is not None:
            self._refill(usage, rate)
            unused = max(ticket.reserved_tokens - used_tokens, 0)
            usage.tokens = min(float(rate), usage.tokens + unused)
