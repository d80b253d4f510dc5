"""Kopf handlers for `inferencepools.kvrail.dev`: thin shells around the pure core.

- create, resume and update (of `spec`) share one reconcile: build, server-side apply, delete
  stale children, then write the status. A refused spec or child sets `Degraded` and raises
  `PermanentError` (no crash loop, no retries until the spec changes); API hiccups raise
  `TemporaryError` and Kopf retries later. GAIE mode without GAIE's CRD sets `Degraded`
  (`InferenceExtensionMissing`) with a warning Event and is retried every minute, so installing
  the CRD is enough. Handlers never sleep.
- a timer re-reads the workloads and refreshes status (ready counts, conditions).
- the plan timer runs the planner every `spec.autoscaling.intervalSeconds` (Kopf ticks every
  second; the handler returns at once until the interval has passed) when autoscaling is enabled.
  Its state (recommendation history, last change) is the pool's in-memory `memo`: a restarted
  operator starts with none, and the planner then waits a full stabilization window first.
- the delete handler (Kopf's finalizer `kopf.kvrail.dev/finalizer`) removes what the garbage
  collector cannot see: the pool's etcd keys and its JetStream stream. The children need no
  handler: the pool is their controller owner, so the garbage collector removes them.

Cleanup is bounded on purpose. While etcd or NATS cannot be reached it raises `TemporaryError`
and Kopf retries after `operator_cleanup_retry_delay_s`; after `operator_cleanup_retries`
retries it posts a `CleanupAbandoned` warning Event naming what was left behind and lets the
delete finish. A pool whose etcd is gone for good (a decommissioned cluster, a typo in
`spec.infrastructure`) can so still be deleted, without anyone editing finalizers by hand; what
it leaves is a key prefix and a stream that nothing uses any more, which the Event names.

The API client, build context, settings and etcd/NATS connections live in Kopf's `memo`, set up
by `kvrail.operator.main`.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

import kopf
from kubernetes.dynamic.exceptions import DynamicApiError
from pydantic import ValidationError
from urllib3.exceptions import HTTPError

from kvrail.crd.pool import GROUP, PLURAL, VERSION, InferencePool
from kvrail.keys import PoolKeys
from kvrail.operator import metrics
from kvrail.operator.apply import (
    ApplyRefusedError,
    InferenceExtensionMissingError,
    observe_workloads,
    reconcile,
)
from kvrail.operator.autoscale import autoscaler
from kvrail.operator.autoscale.planner import PlannerState
from kvrail.operator.planes import PlaneError, delete_pool_data, pool_settings
from kvrail.operator.status import (
    APPLY_FAILED,
    INFERENCE_EXTENSION_MISSING,
    INVALID_SPEC,
    Problem,
    compute_status,
    keep_transition_times,
)

RETRY_DELAY_S = 10
MISSING_CRD_RETRY_DELAY_S = 60
OBSERVE_INTERVAL_S = 10
PLAN_TICK_S = 1.0
CLEANED_UP = "CleanedUp"
CLEANUP_RETRYING = "CleanupRetrying"
CLEANUP_ABANDONED = "CleanupAbandoned"


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
    except InferenceExtensionMissingError as err:
        _write_status(body, patch, memo, pool, Problem(INFERENCE_EXTENSION_MISSING, str(err)))
        kopf.warn(body, reason=INFERENCE_EXTENSION_MISSING, message=str(err))
        raise kopf.TemporaryError(str(err), delay=MISSING_CRD_RETRY_DELAY_S) from err
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


def _autoscaling_enabled(spec: kopf.Spec, **_: Any) -> bool:
    return bool(spec.get("autoscaling", {}).get("enabled", False))


@kopf.timer(GROUP, VERSION, PLURAL, interval=PLAN_TICK_S, when=_autoscaling_enabled,
            id="plan-inferencepool")  # fmt: skip
async def plan_inferencepool(
    body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, logger: kopf.Logger, **_: Any
) -> None:
    try:
        pool = _parse(body)
    except ValidationError:
        return
    interval_s = pool.spec.autoscaling.interval_seconds
    now_s = time.time()
    previous_s = memo.get("planner_tick_s", 0.0)
    if now_s - previous_s < interval_s:
        return
    memo.planner_tick_s = now_s
    state = memo.get("planner_state") or PlannerState()
    if now_s - previous_s > 3 * interval_s:
        state = PlannerState()  # the planner was off or stalled: its history says nothing now
    recorded = body.get("status", {}).get("autoscaling") or {}
    try:
        result = await autoscaler.tick(
            memo.cluster, memo.planes, memo.settings, pool, state, recorded, now_s
        )
    except (DynamicApiError, HTTPError) as err:
        raise kopf.TemporaryError(f"API error, retrying: {err}", delay=RETRY_DELAY_S) from err
    memo.planner_state = result.state
    for d in result.decisions:
        if d.is_change:
            logger.info(
                "planner pool=%s role=%s current=%d desired=%d reason=%s dry_run=%s",
                *(pool.metadata.name, d.role, d.current, d.desired, d.reason, d.dry_run),
            )
    for reason, message in result.events:
        kopf.info(body, reason=reason, message=message)
    if result.status is not None:
        patch.status["autoscaling"] = result.status


@kopf.on.delete(GROUP, VERSION, PLURAL, id="delete-inferencepool")
async def delete_inferencepool(
    body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, retry: int, **_: Any
) -> None:
    if memo.get("cleanup_done"):
        # Kopf can run a delete handler again while it stops the pool's timers; the work is
        # done (or abandoned) already.
        return
    namespace, name = body.meta["namespace"], body.meta["name"]
    try:
        infrastructure = _parse(body).spec.infrastructure
    except ValidationError:
        infrastructure = None  # an invalid spec: clean up on the operator's default endpoints
    settings = pool_settings(memo.settings, namespace, name, infrastructure)
    keys = PoolKeys(namespace, name)
    metrics.forget(namespace, name)
    try:
        had_stream = (await delete_pool_data(memo.planes, settings))[1]
    except PlaneError as err:
        limit = memo.settings.operator_cleanup_retries
        left = f"etcd prefix {keys.pool_prefix} and stream {keys.prefill_stream}"
        if retry < limit:
            delay = memo.settings.operator_cleanup_retry_delay_s
            message = f"attempt {retry + 1} of {limit + 1} failed, retrying in {delay:g}s: {err}"
            kopf.warn(body, reason=CLEANUP_RETRYING, message=message)
            raise kopf.TemporaryError(f"cleanup: {message}", delay=delay) from err
        message = f"gave up after {retry + 1} attempts, {left} left behind: {err}"
        logger.warning("cleanup abandoned pool=%s %s", name, message)
        kopf.warn(body, reason=CLEANUP_ABANDONED, message=message)
        memo.cleanup_done = True
        return
    message = f"deleted etcd prefix {keys.pool_prefix}" + (
        f" and stream {keys.prefill_stream}" if had_stream else " (no stream)"
    )
    logger.info("cleaned up pool=%s %s", name, message)
    kopf.info(body, reason=CLEANED_UP, message=message)
    memo.cleanup_done = True
