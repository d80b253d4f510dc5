"""The model's chat fields (`chatTemplate`, `toolCallParser`, `reasoningParser`) reach the router
alone, as its settings and a mounted file, for both engines; the workers never change with them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvrail.crd.pool import InferencePool
from kvrail.operator.builders.children import ChildRef, build_children, stale_children
from kvrail.operator.builders.context import BuildContext
from kvrail.operator.testing import VLLM, make_pool, mutate, pool_manifest
from kvrail.operator.testing_chat import HERMES_THINK, template
from kvrail.settings import load_settings

CTX = BuildContext(image="registry.example/kvrail:test")
CHAT = (template("qwen3-template", "qwen3.jinja"), *HERMES_THINK)


def pool_with(*changes: tuple[str, Any]) -> InferencePool:
    return make_pool(mutate(pool_manifest(), *changes))


def workload(pool: InferencePool, kind: str, name: str) -> dict[str, Any]:
    (found,) = [
        c for c in build_children(pool, CTX) if c["kind"] == kind and c["metadata"]["name"] == name
    ]
    return found


def router_pod(pool: InferencePool) -> dict[str, Any]:
    return workload(pool, "Deployment", "tiny-router")["spec"]["template"]["spec"]  # type: ignore[no-any-return]


def literal_env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container["env"] if "value" in e}


@pytest.mark.parametrize("engine", [(), VLLM], ids=["kvrail", "vllm"])
def test_the_template_key_is_mounted_in_the_router_and_its_settings_read_it(
    engine: tuple[tuple[str, Any], ...],
) -> None:
    pod = router_pod(pool_with(*engine, *CHAT))
    (volume,) = [v for v in pod["volumes"] if "configMap" in v]
    assert volume["configMap"]["name"] == "qwen3-template"
    assert volume["configMap"]["items"] == [{"key": "qwen3.jinja", "path": "chat_template.jinja"}]
    (router,) = pod["containers"]
    (mount,) = [m for m in router["volumeMounts"] if m["name"] == volume["name"]]
    assert mount["readOnly"] is True
    settings = load_settings(environ=literal_env(router))
    assert settings.chat_template == Path(mount["mountPath"]) / "chat_template.jinja"
    assert (settings.tool_call_parser, settings.reasoning_parser) == ("hermes", "think")


def test_a_pool_without_chat_fields_leaves_the_router_to_detect_from_the_models_template() -> None:
    """`auto` sets nothing: the settings' own default, so routers of pools that never set these
    keep their pod template when the operator is upgraded."""
    router = router_pod(make_pool())
    assert not [v for v in router["volumes"] if "configMap" in v]
    env = literal_env(router["containers"][0])
    assert not {"KVRAIL_CHAT_TEMPLATE", "KVRAIL_TOOL_CALL_PARSER", "KVRAIL_REASONING_PARSER"} & set(
        env
    )
    settings = load_settings(environ=env)
    assert (settings.chat_template, settings.tool_call_parser, settings.reasoning_parser) == (
        None, "auto", "auto",
    )  # fmt: skip
    explicit_auto = pool_with(("spec.model.toolCallParser", "auto"))
    assert router_pod(explicit_auto) == router_pod(make_pool())


def test_one_parser_alone_reaches_the_router() -> None:
    pod = router_pod(pool_with(("spec.model.reasoningParser", "none")))
    env = literal_env(pod["containers"][0])
    assert env["KVRAIL_REASONING_PARSER"] == "none"
    assert "KVRAIL_TOOL_CALL_PARSER" not in env
    assert "KVRAIL_CHAT_TEMPLATE" not in env


@pytest.mark.parametrize("engine", [(), VLLM], ids=["kvrail", "vllm"])
def test_chat_fields_roll_the_router_and_never_the_workers(
    engine: tuple[tuple[str, Any], ...],
) -> None:
    before, after = pool_with(*engine), pool_with(*engine, *CHAT)
    for role in ("prefill", "decode"):
        name = f"tiny-{role}"
        assert workload(after, "StatefulSet", name) == workload(before, "StatefulSet", name)
    assert router_pod(after) != router_pod(before)


def test_vllm_gets_no_chat_flags_the_router_renders_and_parses_for_it() -> None:
    """vLLM is sent token ids on `/v1/completions` (`kvrail.vllm.protocol`): its own chat
    template and parsers would apply to nothing on kvrail's path."""
    pod = workload(pool_with(*VLLM, *CHAT), "StatefulSet", "tiny-decode")["spec"]["template"]
    (engine,) = [c for c in pod["spec"]["containers"] if c["name"] == "engine"]
    flags = {"--chat-template", "--tool-call-parser", "--enable-auto-tool-choice",
             "--reasoning-parser"}  # fmt: skip
    assert not flags & set(engine["command"])
    assert not [v for v in pod["spec"]["volumes"] if "configMap" in v]


def test_the_routers_chat_settings_are_the_same_for_both_engines() -> None:
    def chat_env(pool: InferencePool) -> dict[str, str]:
        env = literal_env(router_pod(pool)["containers"][0])
        return {k: v for k, v in env.items() if k in ("KVRAIL_CHAT_TEMPLATE",
                "KVRAIL_TOOL_CALL_PARSER", "KVRAIL_REASONING_PARSER")}  # fmt: skip

    assert chat_env(pool_with(*VLLM, *CHAT)) == chat_env(pool_with(*CHAT))
    assert len(chat_env(pool_with(*CHAT))) == 3


def test_a_template_configmap_named_like_the_old_router_config_is_never_deleted() -> None:
    """The CRD refuses `<pool>-config` for the template; a pool stored before that rule (Helm
    never upgrades CRDs) still must not lose the user's ConfigMap as a stale child."""
    old_config = ChildRef("v1", "ConfigMap", "tiny-config")
    assert old_config in stale_children(make_pool(), CTX)
    assert old_config not in stale_children(pool_with(template("tiny-config")), CTX)
    assert old_config in stale_children(pool_with(template("tiny-config-v2")), CTX)
