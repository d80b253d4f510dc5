"""What a test on the real node looks at: pods and their readiness, a pod's Prometheus metrics,
and what a pool left in the chart's own etcd and NATS (reached from the host through the routes
into the node, with the chart's credentials read back from its Secrets)."""

from __future__ import annotations

import base64
import json
import threading
import urllib.request
from pathlib import Path
from typing import Any

import openai
from nats.js.errors import NotFoundError
from prometheus_client.parser import text_string_to_metric_families

from kvrail.bus import PrefillQueue, connect
from kvrail.keys import PoolKeys
from kvrail.registry import etcd_client
from kvrail.settings import Settings
from kvrail.testing.kubectl import kubectl


def get_json(kubeconfig: Path, *args: str) -> dict[str, Any]:
    return dict(json.loads(kubectl(kubeconfig, "get", *args, "-o", "json")))


def pods(kubeconfig: Path, namespace: str, selector: str = "") -> list[dict[str, Any]]:
    args = ["pods", "-n", namespace, *(["-l", selector] if selector else [])]
    return list(get_json(kubeconfig, *args)["items"])


def conditions(status: dict[str, Any]) -> dict[str, str]:
    """An object's (or a status entry's) conditions: type -> status."""
    return {c["type"]: c["status"] for c in status.get("conditions", [])}


def is_ready(pod: dict[str, Any]) -> bool:
    """Running, not terminating, and Ready by its readiness probe."""
    status = pod.get("status", {})
    return (
        status.get("phase") == "Running"
        and "deletionTimestamp" not in pod["metadata"]
        and conditions(status).get("Ready") == "True"
    )


def stream_outcome(
    client: openai.OpenAI, model: str, prompt: str, max_tokens: int, started: threading.Event
) -> str:
    """A greedy chat streamed to its end: `finished:<reason>`, `error:<kind>` for an API error,
    or that it ended without a finish reason. `started` is set at the first chunk (or the
    error), so a caller can act while the stream is under way."""
    try:
        out = client.chat.completions.create(
            model=model, temperature=0, max_tokens=max_tokens, stream=True,
            messages=[{"role": "user", "content": prompt}],
        )  # fmt: skip
        outcome = "ended without a finish reason"
        for chunk in out:
            started.set()
            if chunk.choices and chunk.choices[0].finish_reason:
                outcome = f"finished:{chunk.choices[0].finish_reason}"
    except openai.APIError as err:
        outcome = f"error:{type(err).__name__}"
    started.set()
    return outcome


def pod_list_ready(pod_list: list[dict[str, Any]]) -> bool:
    """Every pod Ready, Job pods (a hook that ran) excepted once they succeeded."""
    return all(is_ready(p) or p.get("status", {}).get("phase") == "Succeeded" for p in pod_list)


def restarts(pod_list: list[dict[str, Any]]) -> dict[str, int]:
    return {
        p["metadata"]["name"]: sum(
            c["restartCount"] for c in p["status"].get("containerStatuses", [])
        )
        for p in pod_list
    }


def metric_total(url: str, name: str) -> float:
    """The sum over every label set of the metric family `name` (a counter's `_total` samples)."""
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    total = 0.0
    for family in text_string_to_metric_families(text):
        if family.name == name.removesuffix("_total"):
            total += sum(s.value for s in family.samples if s.name == name)
    return total


def chart_planes(kubeconfig: Path, namespace: str, release: str, workdir: Path) -> Settings:
    """Settings that reach the chart's in-cluster etcd (its pod: the Service is headless) and
    NATS (its Service) with the chart's generated credentials, as the operator does."""
    etcd_ip = get_json(kubeconfig, "pod", f"{release}-etcd-0", "-n", namespace)["status"]["podIP"]
    nats_ip = get_json(kubeconfig, "service", f"{release}-nats", "-n", namespace)["spec"][
        "clusterIP"
    ]
    creds: dict[str, tuple[str, Path]] = {}
    for server in ("etcd", "nats"):
        data = get_json(kubeconfig, "secret", f"{release}-{server}-credentials", "-n", namespace)
        plain = {k: base64.b64decode(v).decode() for k, v in data["data"].items()}
        path = workdir / f"{server}-password"
        path.write_text(plain["password"])
        path.chmod(0o600)
        creds[server] = (plain["username"], path)
    return Settings.model_validate(
        {
            "etcd_endpoints": (f"http://{etcd_ip}:2379",),
            "etcd_username": creds["etcd"][0],
            "etcd_password_file": creds["etcd"][1],
            "nats_url": f"nats://{nats_ip}:4222",
            "nats_user": creds["nats"][0],
            "nats_password_file": creds["nats"][1],
        }
    )


async def pool_traces(planes: Settings, namespace: str, pool: str) -> tuple[int, int | None]:
    """(etcd keys under the pool's prefix, jobs in its JetStream stream or None when the stream
    does not exist)."""
    keys = PoolKeys(namespace, pool)
    async with etcd_client(planes) as etcd:
        num_keys = len(list(await etcd.get_prefix(keys.pool_prefix.encode())))
    nc = await connect(planes, "kvrail-node-test")
    try:
        backlog: int | None = await PrefillQueue(nc.jetstream(), keys).backlog()
    except NotFoundError:
        backlog = None
    finally:
        await nc.close()
    return num_keys, backlog
