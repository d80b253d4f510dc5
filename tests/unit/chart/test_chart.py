"""The Helm chart `charts/kvrail`: its CRD copy, its values schema, lint, and golden renders.

Schema tests run everywhere (jsonschema); tests marked `helm` run the pinned helm binary.
Golden renders (`golden/<ci file>.yaml`) come from `helm template --kube-version 1.36`, with
generated passwords redacted; rewrite them with `KVRAIL_UPDATE_GOLDEN=1 pytest tests/unit/chart`.
"""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from kvrail.crd.gen import CRD_FILENAME, render
from kvrail.operator.builders.env import SECRETS_DIR
from kvrail.settings import Settings, load_settings

REPO = Path(__file__).resolve().parents[3]
CHART = REPO / "charts" / "kvrail"
CI_FILES = sorted((CHART / "ci").glob("*-values.yaml"))
KUBE_VERSION = "1.36"
RELEASE, NAMESPACE = "kvrail", "kvrail-system"
REDACTED = "PGdlbmVyYXRlZD4="  # base64 of "<generated>"


def schema() -> dict[str, Any]:
    return json.loads((CHART / "values.schema.json").read_text())  # type: ignore[no-any-return]


def helm(binary: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(binary), *args], capture_output=True, text=True, timeout=120, check=False
    )


def template(binary: Path, *args: str) -> str:
    done = helm(binary, "template", RELEASE, str(CHART), "--namespace", NAMESPACE,
                "--kube-version", KUBE_VERSION, *args)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout


def redact(text: str) -> str:
    """Replace generated passwords (random per render) in Secrets with a fixed placeholder."""
    docs = text.split("\n---\n")
    return "\n---\n".join(
        re.sub(r"(?m)^(  password: ).*$", rf"\g<1>{REDACTED}", d) if "\nkind: Secret\n" in d else d
        for d in docs
    )


def docs(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if d]


def test_chart_crd_is_a_byte_copy_of_the_generated_crd() -> None:
    copy = (CHART / "crds" / CRD_FILENAME).read_text()
    assert copy == render(), f"run: cp crds/{CRD_FILENAME} charts/kvrail/crds/"
    assert [p.name for p in (CHART / "crds").iterdir()] == [CRD_FILENAME]


@pytest.mark.parametrize(
    "path", [CHART / "values.yaml", *CI_FILES], ids=["values.yaml", *[p.name for p in CI_FILES]]
)
def test_values_file_validates_against_the_schema(path: Path) -> None:
    jsonschema.Draft7Validator.check_schema(schema())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    override = yaml.safe_load(path.read_text()) or {}
    jsonschema.validate(_merge(values, override), schema())
    jsonschema.validate(values, schema())


@pytest.mark.parametrize(
    ("change", "error"),
    [
        ({"operator": {"replicas": 2}}, "Additional properties"),
        ({"etcd": {"enabled": "yes"}}, "is not of type 'boolean'"),
        ({"nats": {"url": "http://nats:4222"}}, "does not match"),
        ({"operator": {"image": {"pullPolicy": "Sometimes"}}}, "is not one of"),
        ({"operator": {"watchNamespaces": ["Not_A_Namespace"]}}, "does not match"),
        ({"crds": {"upgrade": True}}, "Additional properties"),
        ({"etcd": {"persistence": {"size": "lots"}}}, "does not match"),
        ({"operator": {"metricsPort": "9090"}}, "is not of type"),
        ({"operator": {"metricsPort": 70000}}, "is greater than the maximum"),
        ({"etcd": {"caSecret": "Not_A_Secret"}}, "does not match"),
        ({"nats": {"tls": {"ca": "x"}}}, "Additional properties"),
    ],
)
def test_schema_refuses_unknown_keys_and_wrong_types(change: dict[str, Any], error: str) -> None:
    values = _merge(yaml.safe_load((CHART / "values.yaml").read_text()), change)
    with pytest.raises(jsonschema.ValidationError, match=error):
        jsonschema.validate(values, schema())


def test_component_blocks_share_their_sub_keys() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    shared = {"enabled", "image", "resources", "nodeSelector", "tolerations"}
    for block in ("operator", "etcd", "nats"):
        assert shared <= values[block].keys(), block
    assert values["etcd"].keys() - {"endpoints"} == values["nats"].keys() - {"url"}
    assert set(values["crds"]) == {"enabled"}


def _merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


@pytest.mark.helm
def test_helm_lint_is_clean_with_every_ci_values_file(helm_binary: Path) -> None:
    for path in [None, *CI_FILES]:
        args = ["-f", str(path)] if path else []
        done = helm(helm_binary, "lint", str(CHART), "--strict", "--kube-version", KUBE_VERSION,
                    *args)  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        assert "[WARNING]" not in done.stdout and "[ERROR]" not in done.stdout, done.stdout


@pytest.mark.helm
@pytest.mark.parametrize("path", CI_FILES, ids=[p.name for p in CI_FILES])
def test_render_matches_the_golden_file(helm_binary: Path, path: Path) -> None:
    rendered = redact(template(helm_binary, "-f", str(path)))
    golden = CHART / "golden" / path.name.replace("-values.yaml", ".yaml")
    if os.environ.get("KVRAIL_UPDATE_GOLDEN") == "1":
        golden.write_text(rendered)
    assert golden.is_file(), f"no {golden}: run with KVRAIL_UPDATE_GOLDEN=1"
    assert rendered == golden.read_text(), f"{golden.name} is stale: KVRAIL_UPDATE_GOLDEN=1"


@pytest.mark.helm
def test_generated_passwords_are_random_and_never_committed(helm_binary: Path) -> None:
    first, second = template(helm_binary), template(helm_binary)
    secrets = [d for d in docs(first) if d["kind"] == "Secret"]
    assert {s["metadata"]["name"] for s in secrets} == {
        "kvrail-etcd-credentials",
        "kvrail-nats-credentials",
    }
    assert first != second, "generated passwords must differ between renders"
    for secret in secrets + [d for d in docs(second) if d["kind"] == "Secret"]:
        password = base64.b64decode(secret["data"]["password"]).decode()
        # 32 letters and digits, a letter first: nats-server parses a leading digit as a number
        assert len(password) == 32 and password.isalnum() and password[0].isalpha(), password[0]
    for golden in (CHART / "golden").glob("*.yaml"):
        for doc in docs(golden.read_text()):
            if doc["kind"] == "Secret":
                assert doc["data"]["password"] == REDACTED, golden.name


@pytest.mark.helm
def test_operator_runs_kopf_standalone_on_all_or_listed_namespaces(helm_binary: Path) -> None:
    def args(*values: str) -> list[str]:
        text = template(helm_binary, "--show-only", "templates/operator/deployment.yaml", *values)
        (deployment,) = docs(text)
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        return [*container["command"], *container["args"]]

    everywhere = args()
    assert everywhere[:3] == ["kopf", "run", "--standalone"]
    assert "--all-namespaces" in everywhere
    assert everywhere[-2:] == ["-m", "kvrail.operator.main"]
    listed = args("--set", "operator.watchNamespaces={a,b}")
    assert "--all-namespaces" not in listed
    assert {"--namespace=a", "--namespace=b"} <= set(listed)


@pytest.mark.helm
def test_rbac_is_cluster_wide_only_without_watch_namespaces(helm_binary: Path) -> None:
    rbac_kinds = {"ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"}

    def kinds(*values: str) -> list[tuple[str, str]]:
        rendered = [d for d in docs(template(helm_binary, *values)) if d["kind"] in rbac_kinds]
        return sorted((d["kind"], d["metadata"].get("namespace", "")) for d in rendered)

    assert kinds() == [("ClusterRole", ""), ("ClusterRole", ""),
                       ("ClusterRoleBinding", ""), ("ClusterRoleBinding", "")]  # fmt: skip
    assert kinds("--set", "operator.watchNamespaces={a,b}") == [
        ("ClusterRole", ""), ("ClusterRoleBinding", ""),
        ("Role", "a"), ("Role", "b"), ("RoleBinding", "a"), ("RoleBinding", "b"),
    ]  # fmt: skip

    def granted(*values: str) -> set[tuple[str, str]]:
        text = template(helm_binary, "--show-only", "templates/rbac/clusterrole.yaml", *values)
        return {
            (r, v)
            for doc in docs(text)
            if doc["kind"] == "ClusterRole"
            for rule in doc["rules"]
            for r in rule["resources"]
            for v in rule["verbs"]
        }

    rules = granted()
    assert not {v for r, v in rules if r in {"pods", "nodes"}}
    # Secrets: written (a pool's <pool>-infrastructure), never read; none without shareAccess.
    assert {v for r, v in rules if r == "secrets"} == {"create", "patch", "delete"}
    assert not {v for r, v in granted("--set", "operator.shareAccess=false") if r == "secrets"}
    assert all(v != "*" and r != "*" for r, v in rules)
    assert ("inferencepools/status", "patch") in rules


@pytest.mark.helm
@pytest.mark.parametrize(
    ("values", "error"),
    [
        (("etcd.endpoints={http://etcd:2379}",), "either enabled"),
        (("nats.url=nats://nats:4222",), "either enabled"),
        (("operator.serviceAccount.create=false",), "serviceAccount.name is required"),
        (("operator.bogus=1",), "additional properties"),
        (("operator.metricsPort=8080",), "must not be 8080"),
        (("etcd.caSecret=etcd-ca",), "for an external etcd"),
        (("nats.caSecret=nats-ca",), "for an external NATS"),
    ],
)
def test_helm_refuses_inconsistent_values(
    helm_binary: Path, values: tuple[str, ...], error: str
) -> None:
    sets = [a for v in values for a in ("--set", v)]
    done = helm(helm_binary, "template", RELEASE, str(CHART), "--kube-version", KUBE_VERSION, *sets)
    assert done.returncode != 0
    assert error in done.stderr, done.stderr


# The operator's own etcd and NATS settings (delete cleanup and planner): endpoints, credentials
# as a Secret reference plus mounted files, never literal values; the optional metrics port.

OPERATOR = "templates/operator/deployment.yaml"
EXTERNAL_ETCD = ("https://etcd-0.example.internal:2379", "https://etcd-1.example.internal:2379")


def _operator_pod(text: str) -> dict[str, Any]:
    (deployment,) = [d for d in docs(text) if d["kind"] == "Deployment"]
    return deployment["spec"]["template"]["spec"]  # type: ignore[no-any-return]


def _env(pod: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in pod["containers"][0].get("env") or []}


def _mounted_secret(pod: dict[str, Any], path: str) -> tuple[str, str]:
    """(Secret name, key) of the file at `path` in the operator container."""
    folder, _, filename = path.rpartition("/")
    (mount,) = [m for m in pod["containers"][0]["volumeMounts"] if m["mountPath"] == folder]
    assert mount.get("readOnly") is True, mount
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    secret = volume["secret"]
    (item,) = [i for i in secret["items"] if i["path"] == filename]
    return secret["secretName"], item["key"]


def _etcd_auth_credentials(text: str) -> str:
    """The Secret whose password the etcd auth Job gives root: kvrail.etcd_auth reads it from
    the mounted Secret, so it is in no command line and no environment."""
    (job,) = [d for d in docs(text) if d["kind"] == "Job" and "etcd-auth" in d["metadata"]["name"]]
    pod = job["spec"]["template"]["spec"]
    assert "initContainers" not in pod
    (container,) = pod["containers"]
    assert container["command"][:4] == ["python", "-P", "-m", "kvrail.etcd_auth"]
    assert "env" not in container
    password_file = container["command"][-1]
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "credentials"]
    assert mount["readOnly"] and password_file == f"{mount['mountPath']}/password"
    (volume,) = [v for v in pod["volumes"] if v["name"] == "credentials"]
    assert volume["secret"]["items"] == [{"key": "password", "path": "password"}]
    return volume["secret"]["secretName"]  # type: ignore[no-any-return]


def _nats_credentials(text: str) -> str:
    """The Secret the in-cluster NATS is started with: its init container turns the mounted
    `username` and `password` into the file nats.conf includes, and no container of the pod
    has them in its environment (nats-server would parse them as config values)."""
    (nats,) = [
        d for d in docs(text) if d["kind"] == "StatefulSet" and "nats" in d["metadata"]["name"]
    ]
    pod = nats["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    assert init["command"][:4] == ["python", "-P", "-m", "kvrail.nats_auth"]
    secret_dir, out = init["command"][4:]
    mounts = {m["name"]: m["mountPath"] for m in init["volumeMounts"]}
    assert mounts == {"credentials": secret_dir, "auth": str(Path(out).parent)}
    (server,) = pod["containers"]
    assert {"name": "auth", "mountPath": str(Path(out).parent), "readOnly": True} in (
        server["volumeMounts"])  # fmt: skip
    (configmap,) = [d for d in docs(text) if d["kind"] == "ConfigMap"
                    and d["metadata"]["name"] == nats["metadata"]["name"]]  # fmt: skip
    config = configmap["data"]["nats.conf"]
    assert "include ../auth/auth.conf" in config and "$NATS" not in config
    assert not any(e.get("env") for e in [*pod["initContainers"], *pod["containers"]])
    (volume,) = [v for v in pod["volumes"] if v["name"] == "credentials"]
    return volume["secret"]["secretName"]  # type: ignore[no-any-return]


def _operator_settings(pod: dict[str, Any]) -> Settings:
    """What kvrail.settings makes of the operator's environment (Secret references filled)."""
    environ = {
        name: e["value"] if "value" in e else f"<{e['valueFrom']['secretKeyRef']['name']}>"
        for name, e in _env(pod).items()
    }
    return load_settings(environ=environ)


@pytest.mark.helm
@pytest.mark.parametrize(
    ("values", "etcd_secret", "nats_secret"),
    [
        ((), "kvrail-etcd-credentials", "kvrail-nats-credentials"),
        (
            ("-f", str(CHART / "ci" / "existing-secrets-values.yaml")),
            "my-etcd-credentials",
            "my-nats-credentials",
        ),
    ],
    ids=["generated", "existing"],
)
def test_operator_gets_in_cluster_endpoints_and_the_charts_credentials(
    helm_binary: Path, values: tuple[str, ...], etcd_secret: str, nats_secret: str
) -> None:
    text = template(helm_binary, *values)
    pod = _operator_pod(text)
    env = _env(pod)
    # The same Secrets the in-cluster servers are started with (generated or referenced).
    assert _etcd_auth_credentials(text) == etcd_secret
    assert _nats_credentials(text) == nats_secret
    assert env["KVRAIL_ETCD_USERNAME"]["valueFrom"]["secretKeyRef"] == {
        "name": etcd_secret, "key": "username"}  # fmt: skip
    assert env["KVRAIL_NATS_USER"]["valueFrom"]["secretKeyRef"] == {
        "name": nats_secret, "key": "username"}  # fmt: skip
    settings = _operator_settings(pod)
    assert settings.etcd_endpoints == (f"http://{RELEASE}-etcd.{NAMESPACE}.svc:2379",)
    assert settings.nats_url == f"nats://{RELEASE}-nats.{NAMESPACE}.svc:4222"
    # Password files where operator/builders/env.py mounts them for workers.
    assert settings.etcd_password_file == Path(SECRETS_DIR, "etcd-credentials", "password")
    assert settings.nats_password_file == Path(SECRETS_DIR, "nats-credentials", "password")
    assert _mounted_secret(pod, str(settings.etcd_password_file)) == (etcd_secret, "password")
    assert _mounted_secret(pod, str(settings.nats_password_file)) == (nats_secret, "password")
    assert settings.etcd_ca_file is None and settings.nats_ca_file is None
    if not values:  # the generated Secrets are in the render, with the keys referenced
        secrets = {d["metadata"]["name"]: d for d in docs(text) if d["kind"] == "Secret"}
        assert {"username", "password"} <= secrets[etcd_secret]["data"].keys()
        assert {"username", "password"} <= secrets[nats_secret]["data"].keys()


@pytest.mark.helm
def test_operator_gets_external_endpoints_credentials_and_ca_files(helm_binary: Path) -> None:
    pod = _operator_pod(template(helm_binary, "-f", str(CHART / "ci" / "external-values.yaml")))
    env = _env(pod)
    settings = _operator_settings(pod)
    assert settings.etcd_endpoints == EXTERNAL_ETCD
    assert settings.nats_url == "tls://nats.example.internal:4222"
    assert env["KVRAIL_ETCD_USERNAME"]["valueFrom"]["secretKeyRef"]["name"] == (
        "external-etcd-credentials")  # fmt: skip
    assert env["KVRAIL_NATS_USER"]["valueFrom"]["secretKeyRef"]["name"] == (
        "external-nats-credentials")  # fmt: skip
    assert _mounted_secret(pod, str(settings.etcd_password_file)) == (
        "external-etcd-credentials", "password")  # fmt: skip
    assert _mounted_secret(pod, str(settings.nats_password_file)) == (
        "external-nats-credentials", "password")  # fmt: skip
    assert settings.etcd_ca_file == Path(SECRETS_DIR, "etcd-ca", "ca.crt")
    assert settings.nats_ca_file == Path(SECRETS_DIR, "nats-ca", "ca.crt")
    assert _mounted_secret(pod, str(settings.etcd_ca_file)) == ("etcd-ca", "ca.crt")
    assert _mounted_secret(pod, str(settings.nats_ca_file)) == ("nats-ca", "ca.crt")


@pytest.mark.helm
@pytest.mark.parametrize(
    "values",
    [
        ("etcd.auth.enabled=false", "nats.auth.enabled=false"),
        # External servers without auth.existingSecret: nothing to reference (the chart creates
        # no Secret for them), so no credentials rather than a Secret that does not exist.
        (
            "etcd.enabled=false",
            "etcd.endpoints={https://etcd.example:2379}",
            "nats.enabled=false",
            "nats.url=tls://nats.example:4222",
        ),
    ],
    ids=["auth-off", "external-without-secret"],
)
def test_operator_gets_no_credentials_without_a_secret(
    helm_binary: Path, values: tuple[str, ...]
) -> None:
    text = template(helm_binary, *[a for v in values for a in ("--set", v)])
    pod = _operator_pod(text)
    settings = _operator_settings(pod)
    assert (settings.etcd_username, settings.etcd_password_file) == (None, None)
    assert (settings.nats_user, settings.nats_password_file) == (None, None)
    assert [v["name"] for v in pod["volumes"]] == ["tmp"]
    assert not [d for d in docs(text) if d["kind"] == "Secret"]


def _renders(helm_binary: Path) -> list[tuple[str, str]]:
    sets = {
        "auth-off": ("etcd.auth.enabled=false", "nats.auth.enabled=false"),
        "metrics": ("operator.metricsPort=9091",),
    }
    out = [(p.name, template(helm_binary, "-f", str(p))) for p in CI_FILES]
    for name, values in sets.items():
        out.append((name, template(helm_binary, *[a for v in values for a in ("--set", v)])))
    return out


@pytest.mark.helm
def test_no_credential_is_a_literal_env_value_in_any_render(helm_binary: Path) -> None:
    secret_like = re.compile(r"PASS|SECRET|TOKEN|CREDENTIAL", re.IGNORECASE)
    for name, text in _renders(helm_binary):
        for doc in docs(text):
            spec = doc.get("spec", {})
            pod = spec.get("template", {}).get("spec", spec)
            for container in [*pod.get("initContainers", []), *pod.get("containers", [])]:
                for env in container.get("env") or []:
                    if not secret_like.search(env["name"]) or env["name"].endswith("_FILE"):
                        continue
                    assert "value" not in env, (name, doc["kind"], env)
                    assert set(env["valueFrom"]) == {"secretKeyRef"}, (name, env)
                for env in container.get("env") or []:
                    if env["name"].endswith("_FILE") and "value" in env:
                        assert env["value"].startswith(f"{SECRETS_DIR}/"), (name, env)
                # Nothing from a Secret on a command line ($(VAR) is expanded by the kubelet:
                # the node's process list and the runtime's records would show it).
                from_secrets = {e["name"] for e in container.get("env") or []
                                if "secretKeyRef" in e.get("valueFrom", {})}  # fmt: skip
                argv = " ".join([*container.get("command", []), *container.get("args", [])])
                assert not {v for v in from_secrets if f"$({v})" in argv}, (name, container)
        # A generated password appears in its Secret and nowhere else, encoded or not.
        for doc in docs(text):
            if doc["kind"] == "Secret" and "password" in doc.get("data", {}):
                encoded = doc["data"]["password"]
                plain = base64.b64decode(encoded).decode()
                assert text.count(encoded) == 1 and plain not in text, (name, doc["metadata"])


@pytest.mark.helm
def test_operator_env_names_are_settings_fields_in_every_render(helm_binary: Path) -> None:
    for name, text in _renders(helm_binary):
        pod = _operator_pod(text)
        for variable in _env(pod):
            assert variable.startswith("KVRAIL_"), (name, variable)
            assert variable.removeprefix("KVRAIL_").lower() in Settings.model_fields, variable
        _operator_settings(pod)  # kvrail.settings accepts every name and value


@pytest.mark.helm
def test_metrics_port_and_service_appear_only_when_set(helm_binary: Path) -> None:
    def render(*values: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        text = template(helm_binary, *[a for v in values for a in ("--set", v)])
        services = [d for d in docs(text) if d["kind"] == "Service"]
        return _operator_pod(text), services

    for values in [(), ("operator.metricsPort=null",)]:
        pod, services = render(*values)
        assert "KVRAIL_OPERATOR_METRICS_PORT" not in _env(pod)
        assert [p["name"] for p in pod["containers"][0]["ports"]] == ["health"]
        assert not [s for s in services if "metrics" in s["metadata"]["name"]]
        assert _operator_settings(pod).operator_metrics_port is None
    pod, services = render("operator.metricsPort=9091")
    assert _env(pod)["KVRAIL_OPERATOR_METRICS_PORT"] == {
        "name": "KVRAIL_OPERATOR_METRICS_PORT", "value": "9091"}  # fmt: skip
    assert _operator_settings(pod).operator_metrics_port == 9091
    ports = {p["name"]: p["containerPort"] for p in pod["containers"][0]["ports"]}
    assert ports == {"health": 8080, "metrics": 9091}
    (service,) = [s for s in services if s["metadata"]["name"] == f"{RELEASE}-operator-metrics"]
    assert service["spec"]["ports"] == [
        {"name": "metrics", "port": 9091, "targetPort": "metrics", "protocol": "TCP"}]  # fmt: skip
    (deployment,) = docs(template(helm_binary, "--show-only", OPERATOR))
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    # The golden renders: only the ci file that sets metricsPort has the port and Service.
    for path in CI_FILES:
        golden = (CHART / "golden" / path.name.replace("-values.yaml", ".yaml")).read_text()
        port = (yaml.safe_load(path.read_text()) or {}).get("operator", {}).get("metricsPort")
        assert ("KVRAIL_OPERATOR_METRICS_PORT" in golden) == (port is not None), path.name
        assert ("-operator-metrics" in golden) == (port is not None), path.name
