"""The Grafana dashboard `charts/kvrail/dashboards/kvrail.json` against the exported metrics.

Every series a panel or variable queries is one some collector exports under a name from
`kvrail.metrics.ALL` (with prometheus_client's sample suffixes: `_total` for counters, `_bucket`,
`_sum` and `_count` for histograms); every name in `ALL` is on the dashboard or listed in
NOT_ON_DASHBOARD with its reason; every label a query matches, groups by or shows in a legend is
one the metric's collectors declare, or one Prometheus adds (TARGET_LABELS). The collectors come
from the router's, the workers' and the operator's metrics modules (prometheus_client's, and the
router's own `LoopHistogram`, which has no labels); their label names are read from
`_labelnames`, a prometheus_client internal: the public API shows a labelled metric's labels
only once it has a child. The chart's ConfigMap is checked with helm.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import jsonschema
import pytest
import yaml
from prometheus_client import CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase

from kvrail import metrics
from kvrail.epp.metrics import EppMetrics
from kvrail.operator import metrics as operator_metrics
from kvrail.router.metrics import LoopHistogram, RouterMetrics
from kvrail.router.policy import Decision
from kvrail.worker import metrics as worker_metrics

REPO = Path(__file__).resolve().parents[3]
CHART = REPO / "charts" / "kvrail"
DASHBOARD = CHART / "dashboards" / "kvrail.json"
KUBE_VERSION = "1.36"
RELEASE, NAMESPACE = "kvrail", "kvrail-system"

NOT_ON_DASHBOARD: dict[str, str] = {
    metrics.GRAMMAR_MASK_FILL_SECONDS: (
        "an engine cost for benchmarks and tuning (bench/engine/gpu_grammar.py reads it), until "
        "structured outputs have a panel of their own"
    ),
    **{
        name: "vLLM's name, for other gateways' endpoint pickers; its kvrail twin is shown"
        for name in (
            metrics.VLLM_NUM_REQUESTS_RUNNING,
            metrics.VLLM_NUM_REQUESTS_WAITING,
            metrics.VLLM_KV_CACHE_USAGE_PERC,
        )
    },
}
"""Names in kvrail.metrics.ALL deliberately left off the dashboard, with the reason."""

TARGET_LABELS = frozenset({"namespace", "pod"})
"""Labels Prometheus's Kubernetes service discovery adds to every scraped series. The operator's
gauges carry their own `namespace` (the pool's); scraped without honor_labels it arrives as
`exported_namespace`, which is why the operator's panels filter by `pool` only."""

SAMPLE_SUFFIXES = {
    "counter": ("_total",),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count"),
}
"""The series each collector type exposes (prometheus_client strips a counter's `_total` from
its family name and appends it to the sample; `_created` series are not for dashboards)."""

GRAFANA_VARIABLES = frozenset({"__rate_interval", "__interval", "__range", "__all"})

SERIES = re.compile(r"\b(kvrail_[a-z0-9_]+)\s*(?:\{([^}]*)\})?")
MATCHER = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"')
GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
BINARY_MATCHING = re.compile(r"\b(?:on|ignoring|group_left|group_right)\s*\(")
LABEL_VALUES = re.compile(r"^label_values\((.*),\s*([A-Za-z_][A-Za-z0-9_]*)\s*\)$")
LEGEND_LABEL = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")
VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)|\[\[(\w+)\]\]")
STRING = re.compile(r'"(?:[^"\\]|\\.)*"')


# -- what the code exports


Collector = MetricWrapperBase | LoopHistogram


def _collectors() -> dict[str, list[Collector]]:
    """Every collector of the router, the EPP, the workers and the operator, by its name in
    `ALL`."""
    found = [
        *vars(RouterMetrics()).values(),
        *vars(EppMetrics(lambda: 0)).values(),
        *vars(worker_metrics).values(),
        *vars(operator_metrics).values(),
    ]
    out: dict[str, list[Collector]] = {}
    for collector in found:
        if isinstance(collector, MetricWrapperBase | LoopHistogram):
            (family,) = collector.describe()
            name = family.name + "_total" if family.type == "counter" else family.name
            out.setdefault(name, []).append(collector)
    return out


COLLECTORS = _collectors()


def _type(name: str) -> str:
    (kind,) = {family.type for c in COLLECTORS[name] for family in c.describe()}
    return kind


def _exported() -> dict[str, tuple[str, str]]:
    """Sample name -> (name in ALL, suffix) for every series the collectors expose."""
    out = {}
    for name in COLLECTORS:
        base = name.removesuffix("_total") if _type(name) == "counter" else name
        for suffix in SAMPLE_SUFFIXES[_type(name)]:
            out[base + suffix] = (name, suffix)
    return out


EXPORTED = _exported()


def _labels(series: str) -> frozenset[str]:
    """The labels a query may use on `series`: those every collector of its name declares (one
    name can come from several components, e.g. the router's and the workers' TTFT stages), the
    target labels, and `le` on histogram buckets."""
    name, suffix = EXPORTED[series]
    declared = frozenset.intersection(*(_declared(c) for c in COLLECTORS[name]))
    return declared | TARGET_LABELS | ({"le"} if suffix == "_bucket" else set())


def _declared(collector: Collector) -> frozenset[str]:
    """The label names a collector declares (the router's `LoopHistogram` has none)."""
    return frozenset(() if isinstance(collector, LoopHistogram) else collector._labelnames)


def _observed_values() -> dict[tuple[str, str], set[str]]:
    """(sample name, label) -> values, for the closed sets the router's own code sets, read back
    from a fresh registry after exercising it (routing decisions, per-worker gauges)."""
    router = RouterMetrics()
    for matched in (0, 2):
        router.decision(Decision("w0", "kv-aware", matched, 0.0))
    record = SimpleNamespace(worker_id="w0", num_running=1, num_waiting=1, kv_utilization=0.5)
    view = SimpleNamespace(
        decode_workers=lambda: [record], index=SimpleNamespace(num_hashes=lambda w, tier=None: 3)
    )
    router.render(view, {"w0": 1})  # type: ignore[arg-type]
    out: dict[tuple[str, str], set[str]] = {}
    for label, name in [
        ("cache", metrics.ROUTING_DECISIONS_TOTAL),
        ("state", metrics.ROUTER_WORKER_REQUESTS),
    ]:
        out[name, label] = _values(router.registry, name, label)
    return out


def _values(registry: CollectorRegistry, sample: str, label: str) -> set[str]:
    return {
        s.labels[label] for family in registry.collect() for s in family.samples if s.name == sample
    }


# -- what the dashboard queries


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())  # type: ignore[no-any-return]


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))  # rows, collapsed or not


def queries() -> list[tuple[str, str, str]]:
    """(where, PromQL, legend) of every panel target and every query variable."""
    out = []
    for panel in _panels(dashboard()["panels"]):
        for target in panel.get("targets", []):
            where = f"panel {panel['title']!r} target {target['refId']}"
            out.append((where, target["expr"], target.get("legendFormat", "")))
    for variable in dashboard()["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]
            text = query["query"] if isinstance(query, dict) else query
            out.append((f"variable {variable['name']!r}", text, ""))
    return out


def _masked(expr: str) -> str:
    """`expr` with string contents blanked (same length), so parentheses and keywords inside
    label values are not read as PromQL."""
    return STRING.sub(lambda m: '"' + " " * (len(m.group()) - 2) + '"', expr)


def _match(masked: str, start: int, step: int) -> int:
    """Index of the parenthesis matching the one at `start` (step 1: forward, -1: backward)."""
    depth = 0
    for i in range(start, len(masked) if step == 1 else -1, step):
        depth += {"(": 1, ")": -1}.get(masked[i], 0) * step
        if depth == 0:
            return i
    raise AssertionError(f"unbalanced parentheses in {masked!r}")


def groupings(expr: str) -> list[tuple[list[str], str]]:
    """(labels, aggregated expression) of each `by (...)` or `without (...)` clause, in either
    PromQL form: `sum by (a) (x)` or `sum (x) by (a)`."""
    masked = _masked(expr)
    out = []
    for m in GROUPING.finditer(masked):
        labels = [label.strip() for label in m.group(1).split(",") if label.strip()]
        rest = masked[m.end() :]
        after = m.end() + len(rest) - len(rest.lstrip())
        if after < len(masked) and masked[after] == "(":
            out.append((labels, expr[after : _match(masked, after, 1) + 1]))
        else:
            before = len(masked[: m.start()].rstrip()) - 1
            assert masked[before] == ")", f"no aggregated expression for {m.group()!r}: {expr}"
            out.append((labels, expr[_match(masked, before, -1) : before + 1]))
    return out


def series(expr: str) -> list[tuple[str, list[tuple[str, str, str]]]]:
    """(sample name, [(label, operator, value)]) of each kvrail series in `expr`."""
    return [(m.group(1), MATCHER.findall(m.group(2) or "")) for m in SERIES.finditer(expr)]


# -- the dashboard against the code


def test_every_collector_is_named_in_kvrail_metrics_and_agrees_on_its_type() -> None:
    assert set(COLLECTORS) <= set(metrics.ALL), "collector names missing from kvrail/metrics.py"
    for name in COLLECTORS:
        _type(name)  # one type per name, wherever it is collected


def test_every_metric_name_has_a_collector() -> None:
    assert set(metrics.ALL) - set(COLLECTORS) == set()


def test_every_query_uses_exported_kvrail_series_only() -> None:
    for where, expr, _ in queries():
        names = [name for name, _ in series(expr)]
        assert names, f"{where}: no kvrail metric in {expr!r}"
        for name in names:
            assert name in EXPORTED, (
                f"{where}: {name} is not exported (kvrail.metrics.ALL with _total for counters, "
                f"_bucket/_sum/_count for histograms)"
            )
            assert EXPORTED[name][0] in metrics.ALL


def test_every_metric_in_kvrail_metrics_is_on_the_dashboard() -> None:
    shown = {EXPORTED[name][0] for _, expr, _ in queries() for name, _ in series(expr)}
    assert set(NOT_ON_DASHBOARD) <= set(metrics.ALL), "stale NOT_ON_DASHBOARD entries"
    assert not shown & set(NOT_ON_DASHBOARD), "on the dashboard and in NOT_ON_DASHBOARD"
    missing = set(metrics.ALL) - shown - set(NOT_ON_DASHBOARD)
    assert not missing, f"add a panel or list them in NOT_ON_DASHBOARD with a reason: {missing}"


def test_every_matched_label_is_declared_by_the_metrics_collectors() -> None:
    for where, expr, _ in queries():
        for name, matchers in series(expr):
            for label, _, _ in matchers:
                assert label in _labels(name), f"{where}: {name} has no label {label!r}"


def test_every_grouping_label_is_declared_by_each_metric_it_aggregates() -> None:
    for where, expr, _ in queries():
        assert not BINARY_MATCHING.search(_masked(expr)), f"{where}: extend this test for on()"
        for labels, aggregated in groupings(expr):
            names = [name for name, _ in series(aggregated)]
            assert names, f"{where}: by/without over no kvrail metric: {aggregated!r}"
            for label in labels:
                for name in names:
                    assert label in _labels(name), f"{where}: {name} has no label {label!r}"


def test_every_legend_label_survives_the_query() -> None:
    for where, expr, legend in queries():
        grouped = groupings(expr)
        if grouped:
            available = {label for labels, _ in grouped for label in labels}
        else:
            available = {label for name, _ in series(expr) for label in _labels(name)}
        for label in LEGEND_LABEL.findall(legend):
            assert label in available, f"{where}: legend {{{{{label}}}}} not in {available}"


def test_variable_queries_ask_for_declared_labels() -> None:
    variables = [v for v in dashboard()["templating"]["list"] if v["type"] == "query"]
    assert {v["name"] for v in variables} == {"namespace", "pool"}
    for variable in variables:
        assert variable["definition"] == variable["query"]["query"], variable["name"]
        m = LABEL_VALUES.match(variable["query"]["query"])
        assert m, f"variable {variable['name']!r}: not label_values(<series>, <label>)"
        ((name, _),) = series(m.group(1))
        assert m.group(2) in _labels(name), f"variable {variable['name']!r}: {m.group(2)}"


def test_closed_label_values_are_ones_the_code_sets() -> None:
    observed = _observed_values()
    checked = set()
    for where, expr, _ in queries():
        for name, matchers in series(expr):
            for label, op, value in matchers:
                if (name, label) not in observed or op not in ("=", "=~"):
                    continue
                values = value.split("|") if op == "=~" else [value]
                unknown = set(values) - observed[name, label]
                assert not unknown, f"{where}: {name}{{{label}}} is never {unknown}"
                checked.add((name, label))
    assert checked == set(observed), "the dashboard no longer matches these values"


def test_queries_use_only_defined_variables_and_the_datasource_variable() -> None:
    board = dashboard()
    defined = {v["name"] for v in board["templating"]["list"]} | GRAFANA_VARIABLES
    (datasource,) = [v for v in board["templating"]["list"] if v["type"] == "datasource"]
    assert (datasource["name"], datasource["query"]) == ("datasource", "prometheus")
    for where, expr, _ in queries():
        used = {a or b or c for a, b, c in VARIABLE.findall(expr)}
        assert used <= defined, f"{where}: undefined variables {used - defined}"
    ids = []
    for panel in _panels(board["panels"]):
        ids.append(panel["id"])
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert len(set(refs)) == len(refs) > 0, panel["title"]
        assert all(t["datasource"] == panel["datasource"] for t in panel["targets"])
    assert len(set(ids)) == len(ids), "panel ids must be unique"
    assert board["uid"] == "kvrail" and board["schemaVersion"] >= 39


def test_this_test_catches_a_misspelled_metric_or_label() -> None:
    """The checks above on broken copies of real queries (so they cannot pass vacuously)."""
    expr = 'sum by (status) (rate(kvrail_requests_total{namespace=~"$namespace"}[5m]))'
    assert all(label in _labels(n) for n, m in series(expr) for label, _, _ in m)
    assert "kvrail_request_total" not in EXPORTED
    assert "kvrail_kv_cache_utilization_ratio_bucket" not in EXPORTED
    assert "kvrail_requests_total_count" not in EXPORTED
    ((labels, aggregated),) = groupings(expr.replace("status", "stauts"))
    ((name, _),) = series(aggregated)
    assert labels == ["stauts"] and "stauts" not in _labels(name)
    ((labels, aggregated),) = groupings("sum (rate(kvrail_requests_total[5m])) by (endpoint)")
    assert labels == ["endpoint"] and aggregated == "(rate(kvrail_requests_total[5m]))"
    ((_, matchers),) = series('kvrail_requests_total{pool="a", status!~"2.."}')
    assert [label for label, _, _ in matchers] == ["pool", "status"]
    assert "pool" not in _labels("kvrail_requests_total")


# -- the chart ships it


def _chart_values() -> dict[str, Any]:
    return yaml.safe_load((CHART / "values.yaml").read_text())  # type: ignore[no-any-return]


def test_dashboards_are_off_by_default_and_the_schema_checks_their_values() -> None:
    values = _chart_values()
    assert values["dashboards"]["enabled"] is False
    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.validate(values, schema)
    for change, error in [
        ({"labelValue": 1}, "is not of type"),
        ({"label": "not a label"}, "does not match"),
        ({"namespace": "Not_A_Namespace"}, "does not match"),
        ({"folder": "kvrail"}, "Additional properties"),
    ]:
        broken = {**values, "dashboards": {**values["dashboards"], **change}}
        with pytest.raises(jsonschema.ValidationError, match=error):
            jsonschema.validate(broken, schema)


def _render(helm_binary: Path, *sets: str) -> list[dict[str, Any]]:
    args = [a for s in sets for a in ("--set", s)]
    done = subprocess.run(
        [str(helm_binary), "template", RELEASE, str(CHART), "--namespace", NAMESPACE,
         "--kube-version", KUBE_VERSION, *args],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return [d for d in yaml.safe_load_all(done.stdout) if d]


def _dashboard_configmaps(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        d
        for d in docs
        if d["kind"] == "ConfigMap"
        and d["metadata"]["labels"].get("app.kubernetes.io/component") == "dashboards"
    ]


@pytest.mark.helm
def test_chart_ships_the_dashboard_file_for_the_grafana_sidecar(helm_binary: Path) -> None:
    assert _dashboard_configmaps(_render(helm_binary)) == []
    (configmap,) = _dashboard_configmaps(_render(helm_binary, "dashboards.enabled=true"))
    assert configmap["metadata"]["name"] == f"{RELEASE}-dashboards"
    assert configmap["metadata"]["namespace"] == NAMESPACE
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert "annotations" not in configmap["metadata"]
    assert configmap["data"] == {"kvrail.json": DASHBOARD.read_text().rstrip("\n")}
    (configmap,) = _dashboard_configmaps(
        _render(
            helm_binary,
            "dashboards.enabled=true",
            "dashboards.label=example.com/dashboard",
            "dashboards.labelValue=kvrail",
            "dashboards.namespace=monitoring",
            "dashboards.annotations.grafana_folder=kvrail",
        )
    )
    assert configmap["metadata"]["namespace"] == "monitoring"
    assert configmap["metadata"]["labels"]["example.com/dashboard"] == "kvrail"
    assert "grafana_dashboard" not in configmap["metadata"]["labels"]
    assert configmap["metadata"]["annotations"] == {"grafana_folder": "kvrail"}
