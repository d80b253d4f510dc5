"""The user's first hour, on a real node: `helm install` the chart with its bundled etcd and
NATS, `kubectl apply` the CPU example, and the real `openai` client through a real Gateway
(Traefik); then a decode pod deleted under load, prefill scaled out, the pool deleted and the
chart uninstalled. Nothing here is faked: pods run kvrail's image in containerd and runc on a
kubelet, reach each other through kube-proxy's Services and CoreDNS, and are Ready only by
their own probes (`kvrail.testing.real_cluster`; docs/install.md is the same walk for a user).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import openai
import pytest
import yaml

from kvrail.metrics import KV_TRANSFER_BYTES_TOTAL
from kvrail.operator.testing import COLOCATED, mutate
from kvrail.settings import Settings
from kvrail.testing.cluster_checks import (
    chart_planes,
    get_json,
    is_ready,
    metric_total,
    pod_list_ready,
    pods,
    pool_traces,
    restarts,
    stream_outcome,
)
from kvrail.testing.kubectl import kubectl
from kvrail.testing.operator_process import wait_for
from kvrail.testing.real_cluster import RealCluster

pytestmark = [pytest.mark.node, pytest.mark.helm, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "cpu-small.yaml"
RELEASE, CHART_NS, POOL_NS = "kvrail", "kvrail-system", "default"
POOL, REFERENCE = "smol", "smol-colo"
MODEL = "SmolLM2-135M-Instruct"
QUESTION = "What is the capital of France?"
WORKER_METRICS_PORT = 8080
CHILD_KINDS = (
    "configmaps,secrets,services,statefulsets,deployments,poddisruptionbudgets,"
    "networkpolicies,httproutes.gateway.networking.k8s.io"
)
RELEASE_KINDS = (
    "all,configmaps,secrets,serviceaccounts,roles,rolebindings,poddisruptionbudgets,"
    "networkpolicies,jobs,persistentvolumeclaims,gateways.gateway.networking.k8s.io"
)
# Long enough to be prefilled remotely (the example's minRemotePrefillTokens is 256).
LONG_PROMPT = (
    " ".join(f"Fact {i}: the river number {i} flows into lake number {i + 1}." for i in range(40))
    + " Which lake does river number 7 flow into? Answer in one sentence."
)


@dataclass
class Journey:
    cluster: RealCluster
    helm_binary: Path
    workdir: Path
    timings: dict[str, float] = field(default_factory=dict)
    _mark: float = field(default_factory=time.monotonic)

    @property
    def kc(self) -> Path:
        return self.cluster.kubeconfig

    def kubectl(self, *args: str, stdin: str | None = None) -> str:
        return kubectl(self.kc, *args, stdin=stdin, timeout_s=300)

    def helm(self, *args: str) -> str:
        argv = [str(self.helm_binary), f"--kubeconfig={self.kc}", *args]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"helm {' '.join(args)}: {done.stderr}"
        return done.stdout

    def client(self, base_url: str | None = None) -> openai.OpenAI:
        url = base_url or f"http://{self.cluster.gateway_address}/v1"
        return openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)

    def lap(self, step: str) -> None:
        now = time.monotonic()
        self.timings[step] = round(now - self._mark, 1)
        self._mark = now

    def transfer_bytes(self, prefill_pod: str) -> float:
        """KV bytes the prefill pod wrote into decode workers (its own metrics port)."""
        ip = get_json(self.kc, "pod", prefill_pod, "-n", POOL_NS)["status"]["podIP"]
        return metric_total(f"http://{ip}:{WORKER_METRICS_PORT}/metrics", KV_TRANSFER_BYTES_TOTAL)


def chat(client: openai.OpenAI, prompt: str, max_tokens: int = 32) -> str:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=0,
    )
    return reply.choices[0].message.content or ""


def chat_streamed(client: openai.OpenAI, prompt: str, max_tokens: int = 32) -> str:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
    )
    return "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)


def chart_values(cluster: RealCluster) -> list[str]:
    """The chart's gateway values (ci/gateway-values.yaml: Traefik's class and port) and the
    node's images."""
    gateway_values = REPO / "charts" / "kvrail" / "ci" / "gateway-values.yaml"
    return ["-f", str(gateway_values), *cluster.chart_sets()]


def install_and_apply(j: Journey) -> None:
    """The chart as a user installs it (its own test passes), the CPU example, and a colocated
    pool beside it as the reference for remote prefill; every pod Ready through its own probes,
    none restarted."""
    chart = str(REPO / "charts" / "kvrail")
    j.helm("install", RELEASE, chart, "-n", CHART_NS, "--create-namespace",
           *chart_values(j.cluster), "--wait", "--timeout", "5m")  # fmt: skip
    j.helm("test", RELEASE, "-n", CHART_NS, "--timeout", "3m")
    j.lap("helm install and test")
    j.kubectl("apply", "-n", POOL_NS, "-f", str(EXAMPLE))
    example = yaml.safe_load(EXAMPLE.read_text())
    reference = mutate(
        example, *COLOCATED, ("metadata.name", REFERENCE), ("spec.router", {"replicas": 1})
    )
    j.kubectl("apply", "-n", POOL_NS, "-f", "-", stdin=yaml.safe_dump(reference))

    def everything_ready() -> bool:
        found = pods(j.kc, CHART_NS) + pods(j.kc, POOL_NS)
        roles = {p["metadata"]["labels"].get("kvrail.dev/role") for p in pods(j.kc, POOL_NS)}
        return {"prefill", "decode", "router"} <= roles and pod_list_ready(found)

    wait_for("every pod Ready", everything_ready, 600, 2)
    restarted = restarts(pods(j.kc, CHART_NS) + pods(j.kc, POOL_NS))
    assert not {name: n for name, n in restarted.items() if n}, restarted
    j.lap("pools Ready")


def serve_through_the_gateway(j: Journey) -> None:
    """The Gateway reports Traefik's address, the operator's HTTPRoute is accepted, and the
    openai client pointed there gets Paris, streamed and not."""
    gateway = get_json(j.kc, "gateway", RELEASE, "-n", CHART_NS)
    assert [a["value"] for a in gateway["status"]["addresses"]] == [j.cluster.gateway_address]
    route = get_json(j.kc, "httproute", f"{POOL}-router", "-n", POOL_NS)
    (parent,) = route["status"]["parents"]
    assert {c["type"]: c["status"] for c in parent["conditions"]}["Accepted"] == "True"
    client = j.client()

    def served() -> bool:
        try:
            return [m.id for m in client.models.list().data] == [MODEL]
        except openai.APIError:
            return False  # Traefik has not loaded the route's endpoints yet

    wait_for("the route served through the Gateway", served, 60, 0.5)
    answer = chat(client, QUESTION)
    assert "Paris" in answer
    assert chat_streamed(client, QUESTION) == answer
    j.lap("openai client through the Gateway")


def remote_prefill_equals_colocated(j: Journey, planes: Settings) -> None:
    """A long prompt is prefilled remotely (the prefill pod wrote KV into the decode pod over
    NIXL) and the answer equals the colocated pool's, asked through its own router Service; no
    pod logged a prompt or an answer; the reference pool then goes with all it had."""
    before = j.transfer_bytes(f"{POOL}-prefill-0")
    remote = chat(j.client(), LONG_PROMPT, max_tokens=24)
    assert j.transfer_bytes(f"{POOL}-prefill-0") > before, "the long prompt was not remote"
    colo_ip = get_json(j.kc, "service", f"{REFERENCE}-router", "-n", POOL_NS)["spec"]["clusterIP"]
    assert chat(j.client(f"http://{colo_ip}:8000/v1"), LONG_PROMPT, max_tokens=24) == remote
    for pod in pods(j.kc, POOL_NS) + pods(j.kc, CHART_NS):
        meta = pod["metadata"]
        log = j.kubectl("logs", "-n", meta["namespace"], meta["name"], "--all-containers")
        for text in ("capital of France", "Paris", "river number", remote.strip()[:20]):
            assert text not in log, (meta["name"], text)
    j.kubectl("delete", "inferencepools.kvrail.dev", REFERENCE, "-n", POOL_NS, "--wait=true",
              "--timeout=180s")  # fmt: skip
    gone(j, planes, REFERENCE)
    j.lap("remote prefill equals colocated")


def gone(j: Journey, planes: Settings, pool: str) -> None:
    """No child, no pod, no etcd key and no JetStream stream of `pool` left. The operator's
    finalizer deletes the keys while the workers are still draining, and a worker may update its
    record once more before it stops; that record is bound to the worker's lease (3 s), so it
    goes with the worker."""
    selector = f"kvrail.dev/pool={pool}"
    wait_for(
        "no child and no pod left",
        lambda: not j.kubectl("get", f"{CHILD_KINDS},pods", "-n", POOL_NS, "-l", selector,
                              "-o", "name").strip(),
        120, 1,
    )  # fmt: skip
    wait_for(
        "no etcd key and no stream left",
        lambda: asyncio.run(pool_traces(planes, POOL_NS, pool)) == (0, None),
        15,
        1,
    )


def delete_decode_under_load(j: Journey) -> None:
    """The decode pod deleted while requests stream: the router stops choosing it at once (a new
    request is refused with 503 in seconds), the requests in flight end (finished within the
    drain, or with the documented error event), nothing hangs, the StatefulSet brings the pod
    back, and new requests succeed once it is Ready."""
    client, decode = j.client(), f"{POOL}-decode-0"
    old_uid = get_json(j.kc, "pod", decode, "-n", POOL_NS)["metadata"]["uid"]
    started = [threading.Event() for _ in range(3)]

    def stream(i: int) -> tuple[str, float]:
        prompt = (
            f"List the numbers from {i} to {i + 500}, one per line, each followed by its square."
        )
        return stream_outcome(client, MODEL, prompt, 400, started[i]), time.monotonic()

    with ThreadPoolExecutor(len(started)) as executor:
        futures = [executor.submit(stream, i) for i in range(len(started))]
        for event in started:
            assert event.wait(120), "a stream never started"
        j.kubectl("delete", "pod", decode, "-n", POOL_NS, "--wait=false")
        deleted = time.monotonic()

        def refusal() -> tuple[int, float, str] | None:
            """(status, seconds to answer, when it was sent and its x-request-id: what to look
            for in the router's log) of a new request refused; None while one is served (by
            the worker before it heard of its deletion)."""
            start, sent = time.monotonic(), time.strftime("%H:%M:%S")
            try:
                chat(client, QUESTION, max_tokens=4)
            except openai.APIStatusError as err:
                request = f"sent {sent} as {err.response.headers.get('x-request-id')}"
                return err.status_code, time.monotonic() - start, request
            return None

        status, answer_s, request = wait_for("a new request refused", refusal, 15, 0.2)
        refused_after_s = time.monotonic() - deleted
        outcomes = [f.result(timeout=180) for f in futures]
    assert status == 503 and answer_s < 10, (status, answer_s, request)
    assert all(o.startswith(("finished:", "error:")) for o, _ in outcomes), outcomes
    assert all(ended > deleted for _, ended in outcomes), "a stream was not in flight"

    def replaced() -> bool:
        found = pods(j.kc, POOL_NS, f"kvrail.dev/pool={POOL},kvrail.dev/role=decode")
        return bool(found) and found[0]["metadata"]["uid"] != old_uid and is_ready(found[0])

    wait_for("the StatefulSet's new decode pod Ready", replaced, 300, 1)

    def answered() -> str | None:
        try:
            return chat(client, QUESTION)
        except openai.APIStatusError:
            return None

    assert "Paris" in wait_for("a new request served", answered, 60, 1)
    ended = [(o, round(t - deleted, 1)) for o, t in outcomes]
    print(
        f"\nin flight (outcome, s after the delete): {ended}; refused {refused_after_s:.1f}s after"
    )
    j.lap("decode pod deleted under load")


def scale_prefill(j: Journey) -> None:
    """Prefill 1 -> 2 replicas by a spec change: the new worker registers and takes jobs."""
    patch = json.dumps({"spec": {"prefill": {"replicas": 2}}})
    j.kubectl(
        "patch", "inferencepools.kvrail.dev", POOL, "-n", POOL_NS, "--type=merge", "-p", patch
    )
    new = f"{POOL}-prefill-1"

    def new_ready() -> bool:
        return any(p["metadata"]["name"] == new and is_ready(p) for p in pods(j.kc, POOL_NS))

    wait_for(f"{new} Ready", new_ready, 300, 1)
    client = j.client()
    for attempt in range(12):
        chat(client, f"Request {attempt}. {LONG_PROMPT}", max_tokens=2)
        if j.transfer_bytes(new) > 0:
            break
    else:
        raise AssertionError(f"{new} took no prefill job in 12 remote prefills")
    j.lap("prefill scaled to 2")


def delete_pool(j: Journey, planes: Settings) -> None:
    """Deleting the pool removes every child, its etcd keys and its JetStream stream."""
    keys, backlog = asyncio.run(pool_traces(planes, POOL_NS, POOL))
    assert keys > 0 and backlog is not None, (keys, backlog)
    j.kubectl("delete", "inferencepools.kvrail.dev", POOL, "-n", POOL_NS, "--wait=true",
              "--timeout=180s")  # fmt: skip
    gone(j, planes, POOL)
    j.lap("pool deleted")


def uninstall(j: Journey) -> None:
    """helm uninstall leaves nothing behind but the CRD (Helm never deletes a chart's CRDs):
    nothing in the release namespace but its own defaults, no cluster-wide RBAC, no pod but the
    platform's."""
    j.helm("uninstall", RELEASE, "-n", CHART_NS, "--wait", "--timeout", "3m")
    # Helm waits for the workloads' deletion, not for their pods' (terminating with grace).
    wait_for(
        "only the namespace's own objects left",
        lambda: (
            sorted(j.kubectl("get", RELEASE_KINDS, "-n", CHART_NS, "-o", "name").split())
            == ["configmap/kube-root-ca.crt", "serviceaccount/default"]
        ),
        120,
        1,
    )
    instance = f"app.kubernetes.io/instance={RELEASE}"
    assert not j.kubectl("get", "clusterroles,clusterrolebindings", "-l", instance, "-o", "name")
    everywhere = get_json(j.kc, "pods", "-A")["items"]
    assert {p["metadata"]["namespace"] for p in everywhere} == {"kube-system", "traefik-system"}
    assert j.kubectl("get", "crd", "inferencepools.kvrail.dev", "-o", "name").strip()
    j.lap("helm uninstall")


def test_helm_install_apply_serve_through_the_gateway_then_fail_scale_delete_uninstall(
    real_cluster: RealCluster, helm_binary: Path, tmp_path: Path
) -> None:
    j = Journey(real_cluster, helm_binary, tmp_path)
    install_and_apply(j)
    planes = chart_planes(j.kc, CHART_NS, RELEASE, tmp_path)
    serve_through_the_gateway(j)
    remote_prefill_equals_colocated(j, planes)
    delete_decode_under_load(j)
    scale_prefill(j)
    delete_pool(j, planes)
    uninstall(j)
    print(f"steps (s): {j.timings}")
