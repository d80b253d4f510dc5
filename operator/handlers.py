"""Kopf handlers for `inferencepools.kvrail.dev`: thin shells around the pure core.

- create, resume and update (of `spec`) share one reconcile: build, server-side apply, delete
  stale children, then write the status. A refused spec or child sets `Degraded` and raises
  `PermanentError` (no crash loop, no retries until the spec changes); API hiccups raise
  `TemporaryError` and Kopf retries later. Handlers never sleep.
- a timer re-reads the workloads and refreshes status (ready counts, conditions).
- deletion needs no handler: every child has the pool as its controller owner, so the garbage
  collector removes them.

The API client and build context live in Kopf's `memo`, set up by `kvrail.operator.main`.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import kopf
from kubernetes.dynamic.exceptions import DynamicApiError
from pydantic import ValidationError
from urllib3.exceptions import HTTPError

from kvrail.crd import GROUP, PLURAL, VERSION, InferencePool
from kvrail.operator.apply import ApplyRefusedError, observe_workloads, reconcile
from kvrail.operator.status import (
    APPLY_FAILED,
    INVALID_SPEC,
    Problem,
    compute_status,
    keep_transition_times,
)

RETRY_DELAY_S = 10
OBSERVE_INTERVAL_S = 10


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _parse(body: kopf.Body) -> InferencePool:
    return InferencePool.model_validate(
        {k: body.get(k) for k in ("apiVersion", "kind", "spec")} | {"metadata": dict(body.meta)}
    )


def _write_status(
    body: kopf.Body,
    patch: kopf.Patch,
    memo: kopf.Memo,
    pool: InferencePool,
    problem: Problem | None,
) -> None:
    workloads = observe_workloads(memo.cluster, pool)
    status = compute_status(pool, workloads, _now(), problem)
    previous = body.get("status", {}).get("conditions", [])
    status["conditions"] = keep_transition_times(status["conditions"], previous)
    patch.status.update(status)


def _invalid(body: kopf.Body, patch: kopf.Patch, err: ValidationError) -> kopf.PermanentError:
    message = "; ".join(
        f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in err.errors()[:5]
    )
    condition = {
        "status": "False",
        "reason": INVALID_SPEC,
        "message": message,
        "lastTransitionTime": _now(),
        "observedGeneration": body.meta.get("generation", 0),
    }
    patch.status["conditions"] = [
        {**condition, "type": "Ready"},
        {**condition, "type": "Degraded", "status": "True"},
    ]
    kopf.warn(body, reason=INVALID_SPEC, message=message)
    return kopf.PermanentError(f"invalid spec: {message}")


@kopf.on.resume(GROUP, VERSION, PLURAL, id="resume-inferencepool")
@kopf.on.create(GROUP, VERSION, PLURAL, id="create-inferencepool")
@kopf.on.update(GROUP, VERSION, PLURAL, field="spec", id="update-inferencepool")
def reconcile_inferencepool(
    body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, logger: kopf.Logger, **_: Any
) -> None:
    try:
        pool = _parse(body)
    except ValidationError as err:
        raise _invalid(body, patch, err) from err
    try:
        outcome = reconcile(memo.cluster, pool, memo.ctx)
    except ApplyRefusedError as err:
        _write_status(body, patch, memo, pool, Problem(APPLY_FAILED, str(err)))
        kopf.warn(body, reason=APPLY_FAILED, message=str(err))
        raise kopf.PermanentError(str(err)) from err
    except (DynamicApiError, HTTPError) as err:
        raise kopf.TemporaryError(f"API error, retrying: {err}", delay=RETRY_DELAY_S) from err
    message = f"applied={outcome.applied} deleted={','.join(outcome.deleted) or '-'}"
    logger.info("reconciled pool=%s %s", pool.metadata.name, message)
    kopf.info(body, reason="Reconciled", message=message)
    _write_status(body, patch, memo, pool, None)


@kopf.timer(GROUP, VERSION, PLURAL, interval=OBSERVE_INTERVAL_S, id="observe-inferencepool")
def observe_inferencepool(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, **_: Any) -> None:
    try:
        pool = _parse(body)
    except ValidationError:
        return  # the reconcile handler already reported it as Degraded
    try:
        _write_status(body, patch, memo, pool, None)
    except (DynamicApiError, HTTPError) as err:
        raise kopf.TemporaryError(f"API error, retrying: {err}", delay=RETRY_DELAY_S) from err
