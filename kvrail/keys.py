"""Every etcd key and NATS subject kvrail uses, scoped by namespace and pool.

Nothing else builds a key or a subject by hand: a typo here is a typo everywhere, and a test can
check the whole namespace at once. Namespaces, pools and worker ids are DNS-1123 labels (as in
Kubernetes), so they contain no '/', '.', '*' or '>' and cannot escape their scope.

etcd (discovery plane)::

    /kvrail/v1/<namespace>/<pool>/workers/<worker_id>    one record per worker, under its lease

NATS (request plane, work queue)::

    kvrail.<namespace>.<pool>.decode.<worker_id>         requests to one decode worker
    kvrail.<namespace>.<pool>.cancel                     cancels, seen by every worker
    kvrail.<namespace>.<pool>.kv.<worker_id>             KV events (blocks stored/removed)
    kvrail.<namespace>.<pool>.kvstate.<worker_id>        request/reply: a worker's whole KV state
    kvrail.<namespace>.<pool>.debug.<worker_id>          debug queries to one worker (block counts)
    kvrail.<namespace>.<pool>.refused.<worker_id>        prefill jobs refused for this decode worker
    kvrail.<namespace>.<pool>.settled                    prefill jobs whose outcome was consumed
    kvrail.<namespace>.<pool>.prefill.any                prefill jobs for any prefill worker
    kvrail.<namespace>.<pool>.prefill.to.<worker_id>     prefill jobs addressed to one worker
    stream KVRAIL-<namespace>-<pool>-PREFILL             the JetStream work queue of both
"""

from __future__ import annotations

import re
from dataclasses import dataclass

KEY_VERSION = "v1"
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


def check_label(kind: str, value: str) -> str:
    """Return `value` if it is a DNS-1123 label, else raise ValueError naming `kind`."""
    if not _DNS_LABEL.match(value):
        raise ValueError(f"{kind} {value!r} is not a DNS-1123 label")
    return value


@dataclass(frozen=True, slots=True)
class PoolKeys:
    """Keys and subjects of one pool."""

    namespace: str
    pool: str

    def __post_init__(self) -> None:
        check_label("namespace", self.namespace)
        check_label("pool", self.pool)

    # etcd ---------------------------------------------------------------------------------------
    @property
    def pool_prefix(self) -> str:
        """Everything the pool owns in etcd; the operator's finalizer deletes this prefix."""
        return f"/kvrail/{KEY_VERSION}/{self.namespace}/{self.pool}/"

    @property
    def workers_prefix(self) -> str:
        return self.pool_prefix + "workers/"

    def worker(self, worker_id: str) -> str:
        return self.workers_prefix + check_label("worker id", worker_id)

    def worker_id_of(self, key: str) -> str:
        """Inverse of `worker()`; raises ValueError for a key outside this pool's workers."""
        if not key.startswith(self.workers_prefix):
            raise ValueError(f"key {key!r} is not a worker key of pool {self.pool}")
        return check_label("worker id", key[len(self.workers_prefix) :])

    # NATS ---------------------------------------------------------------------------------------
    @property
    def _subject_root(self) -> str:
        return f"kvrail.{self.namespace}.{self.pool}"

    def decode_requests(self, worker_id: str) -> str:
        return f"{self._subject_root}.decode.{check_label('worker id', worker_id)}"

    @property
    def cancel(self) -> str:
        return f"{self._subject_root}.cancel"

    def kv_events(self, worker_id: str) -> str:
        return f"{self._subject_root}.kv.{check_label('worker id', worker_id)}"

    @property
    def kv_events_all(self) -> str:
        return f"{self._subject_root}.kv.*"

    def kv_state(self, worker_id: str) -> str:
        """Request/reply: a worker answers with one `KvEvent` (`cleared=True`, every hash it
        caches, `seq` = its latest event), so a router rebuilds its index after a restart or a
        gap in the event stream."""
        return f"{self._subject_root}.kvstate.{check_label('worker id', worker_id)}"

    def debug(self, worker_id: str) -> str:
        """Request/reply: a worker answers with its `BlockCounts` (tests and operators)."""
        return f"{self._subject_root}.debug.{check_label('worker id', worker_id)}"

    def prefill_refused(self, worker_id: str) -> str:
        """`PrefillDone` with an error, to the job's decode worker: nothing was or will be
        written (a successful completion travels with the NIXL write instead)."""
        return f"{self._subject_root}.refused.{check_label('worker id', worker_id)}"

    def write_grant(self, worker_id: str) -> str:
        """Request/reply: a `WriteGrantRequest` to the job's decode worker, before every write."""
        return f"{self._subject_root}.grant.{check_label('worker id', worker_id)}"

    @property
    def prefill_settled(self) -> str:
        """`PrefillSettled`, seen by every prefill worker: never run or write this job again."""
        return f"{self._subject_root}.settled"

    @property
    def prefill_any(self) -> str:
        return f"{self._subject_root}.prefill.any"

    def prefill_to(self, worker_id: str) -> str:
        return f"{self._subject_root}.prefill.to.{check_label('worker id', worker_id)}"

    @property
    def prefill_subjects(self) -> tuple[str, ...]:
        """The subjects the prefill stream captures."""
        return (self.prefill_any, f"{self._subject_root}.prefill.to.*")

    @property
    def prefill_stream(self) -> str:
        """JetStream stream names allow no '.', so the scope is joined with '-'."""
        return f"KVRAIL-{self.namespace}-{self.pool}-PREFILL"

    @property
    def prefill_consumer(self) -> str:
        """The durable pull consumer all prefill workers of the pool share."""
        return "prefill-workers"


ROOT_PREFIX = f"/kvrail/{KEY_VERSION}/"


def parse_worker_key(key: str) -> tuple[PoolKeys, str] | None:
    """(pool keys, worker id) of a worker key of any pool, or None for any other key."""
    parts = key.removeprefix(ROOT_PREFIX).split("/")
    if not key.startswith(ROOT_PREFIX) or len(parts) != 4 or parts[2] != "workers":
        return None
    try:
        keys = PoolKeys(parts[0], parts[1])
        return keys, check_label("worker id", parts[3])
    except ValueError:
        return None
