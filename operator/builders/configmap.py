"""The pool's ConfigMap: the router's configuration file, `router.json`.

Workers get their settings as explicit environment in their pod template, so a settings change is
always a new StatefulSet revision. The router also mounts this file; its pod template carries the
file's hash, so a change rolls the router too.
"""

from __future__ import annotations

import json
from typing import Any

from kvrail.crd.pool import InferencePool
from kvrail.operator.builders.meta import config_name, model_hash, object_meta, short_hash

ROUTER_CONFIG_KEY = "router.json"


def router_config(pool: InferencePool) -> dict[str, Any]:
    spec = pool.spec
    return {
        "model": spec.model.source,
        "servedModelName": spec.model.served_name,
        "maxModelLen": spec.model.max_model_len,
        "blockSize": spec.model.block_size,
        "modelHash": model_hash(pool),
        "policy": spec.router.policy,
        "disaggregation": spec.disaggregation.model_dump(mode="json"),
    }


def build_configmap(pool: InferencePool) -> dict[str, Any]:
    text = json.dumps(router_config(pool), sort_keys=True, indent=2) + "\n"
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": object_meta(pool, config_name(pool), None),
        "data": {ROUTER_CONFIG_KEY: text},
    }


def config_hash(pool: InferencePool) -> str:
    return short_hash(router_config(pool))
