"""Endpoint strings as Gateway API inference gateways write them: ``ip:port``, an IPv6 address in
brackets (``[fd00::1]:8000``), as in ``x-gateway-destination-endpoint`` and the ``envoy.lb``
metadata. A worker's ``WorkerRecord.http_front`` holds one, written by the worker
(``--http-front``) and read by the endpoint picker (``kvrail.epp``); both go through
:func:`parse_endpoint`, so the record always holds the normalised form.

The kubelet cannot add brackets: a pod manifest that writes ``$(POD_IP):8000`` gives
``fd00::1:8000`` on an IPv6 pod. Since a port is required, the last colon is the port's, and that
form is read as ``[fd00::1]:8000``.
"""

from __future__ import annotations

import ipaddress


def parse_endpoint(text: str) -> str:
    """``ip:port`` checked and normalised (IPv6 as ``[addr]:port``, in its compressed form);
    ``ValueError`` names the problem. Host names are refused: GAIE endpoints are pod addresses."""
    host, sep, port = text.strip().rpartition(":")
    if not sep or not host:
        raise ValueError(f"endpoint {text!r} is not ip:port")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"endpoint {text!r} has no valid port")
    bracketed = host.startswith("[") and host.endswith("]")
    try:
        address = ipaddress.ip_address(host[1:-1] if bracketed else host)
    except ValueError:
        raise ValueError(f"endpoint {text!r} does not start with an IP address") from None
    if address.version == 6:
        return f"[{address}]:{int(port)}"
    if bracketed:
        raise ValueError(f"endpoint {text!r}: only an IPv6 address goes in brackets")
    return f"{address}:{int(port)}"


def endpoint_ip(endpoint: str) -> str:
    """The address of a normalised endpoint, without brackets: ``[fd00::1]:8000`` -> ``fd00::1``."""
    return endpoint.rpartition(":")[0].removeprefix("[").removesuffix("]")


def normalise_hint(item: str) -> str:
    """One entry of a gateway's subset hint, ``ip:port`` or a bare ``ip`` (IPv6 with or without
    brackets), in the form :func:`parse_endpoint` or :func:`endpoint_ip` gives, so it compares
    with normalised endpoints; an entry that is neither is returned stripped (it matches none)."""
    item = item.strip()
    bare = item.removeprefix("[").removesuffix("]")
    try:
        return str(ipaddress.ip_address(bare))
    except ValueError:
        pass
    try:
        return parse_endpoint(item)
    except ValueError:
        return item
