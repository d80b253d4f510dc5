"""The pure parts of bench/sweep/: the plan, the workers' log lines, the synthetic model
directory's tokenizer and weight list, and the report's SLO verdicts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvrail.testing.scripts import load_script

SWEEP = Path(__file__).resolve().parents[3] / "bench" / "sweep"


run: Any = load_script("kvrail_bench_sweep_run", SWEEP / "run.py")
report: Any = load_script("kvrail_bench_sweep_report", SWEEP / "report.py")
model: Any = run.randmodel
lg: Any = run.lg


def _sweep(name: str, rates: tuple[float, ...]) -> Any:
    return run.Sweep(name, lg.Lengths(8, 8), lg.Lengths(2, 2), rates, 10, 5.0)


def test_points_interleave_the_workloads_rate_by_rate() -> None:
    points = run.interleave([_sweep("long", (0.5, 1.0, 2.0)), _sweep("chat", (4.0, 8.0))])
    assert [(p.sweep.name, p.rate) for p in points] == [
        ("long", 0.5), ("chat", 4.0), ("long", 1.0), ("chat", 8.0), ("long", 2.0),
    ]  # fmt: skip


def test_every_point_has_its_own_seed_so_no_prompt_repeats_across_points() -> None:
    points = run.interleave([_sweep("long", (0.5, 1.0)), _sweep("chat", (4.0, 8.0))])
    assert len({p.seed(0) for p in points}) == len(points)


def test_a_points_estimate_counts_warmup_arrivals_and_the_tail() -> None:
    [point] = run.interleave([_sweep("chat", (2.0,))])
    assert point.estimate_s(num_warmup=2) == pytest.approx(12 / 2.0 + 5.0)


def test_worker_specs_give_each_setup_its_roles_and_settings() -> None:
    args = run.parse_args(["--chunk-tokens", "1024", "--kv-blocks", "100"])
    [(worker_id, role, env)] = run.worker_specs("colocated", args)
    assert (worker_id, role) == ("colocated-0", "colocated")
    assert env["KVRAIL_DISAGGREGATION_MODE"] == "colocated"
    assert env["KVRAIL_MAX_NUM_BATCHED_TOKENS"] == "1024"
    prefill, decode = run.worker_specs("disaggregated", args)
    assert (prefill[1], decode[1]) == ("prefill", "decode")
    assert prefill[2]["KVRAIL_MAX_NUM_BATCHED_TOKENS"] == str(args.prefill_tokens)
    assert decode[2]["KVRAIL_MIN_REMOTE_PREFILL_TOKENS"] == "512"
    with pytest.raises(ValueError, match="unknown setup"):
        run.worker_specs("both", args)


def test_the_vllm_setup_has_no_kvrail_worker_and_serves_the_same_model_dir(tmp_path: Path) -> None:
    args = run.parse_args(["--setups", "vllm", "--vllm-python", "venv/bin/python",
                           "--vllm-pythonpath", "/opt/vsite",
                           "--vllm-args", "--dtype float32"])  # fmt: skip
    assert run.worker_specs("vllm", args) == []
    model_dir = tmp_path / "llama3-8b-random"
    argv = run.vllm_argv(args, model_dir, 8123)
    assert argv[0] == str(Path("venv/bin/python").absolute())  # it runs in a folder of its own
    assert argv[1:4] == ["-P", "-m", "vllm.entrypoints.openai.api_server"]
    flags = dict(zip(argv[4::2], argv[5::2], strict=True))
    assert flags["--model"] == str(model_dir)
    assert flags["--served-model-name"] == "llama3-8b-random"  # the name the load generator asks
    assert flags["--port"] == "8123" and flags["--max-model-len"] == str(args.max_model_len)
    assert argv[-2:] == ["--dtype", "float32"]  # last, so that they win
    assert run.vllm_env(args)["PYTHONPATH"] == "/opt/vsite"
    log = (
        "INFO [core.py:133] Initializing a V1 LLM engine (v0.26.0) with config: model='m', "
        "seed=0, served_model_name=m, enable_prefix_caching=True, enable_chunked_prefill=True"
    )
    assert run.vllm_server_facts(log) == {"vllm_version": "0.26.0", "prefix_caching": True}
    assert run.vllm_server_facts("") == {"vllm_version": None, "prefix_caching": None}


def test_worker_log_lines_join_decode_and_prefill_sides_on_the_request_id() -> None:
    decode = (
        "2026-11-29 16:02:07,000 INFO kvrail.worker.roles.decode first token request_id=chatcmpl-a "
        "mode=remote prompt_tokens=8194 admission_s=0.0078 copy_s=0.0150 in_worker_s=1.8300 "
        "prefill_compute_s=1.7963\n"
        "2026-11-29 16:02:08,000 INFO kvrail.worker.roles.decode first token request_id=chatcmpl-b "
        "mode=local prompt_tokens=300 admission_s=0.0000 in_worker_s=0.1200 "
        "prefill_compute_s=0.1000\n"
    )
    prefill = (
        "2026-11-29 16:02:06,900 INFO kvrail.worker.roles.prefill prefill written "
        "request_id=chatcmpl-a~1 dest=decode-0 prompt_tokens=8194 blocks=513 bytes=1 "
        "transfer_s=0.0050 transport=cuda-ipc compute_s=0.3000\n"
    )
    logged: dict[str, dict[str, Any]] = {}
    for text in (prefill, decode):
        for request_id, seen in run.observe.parse_worker_log(text).items():
            logged.setdefault(request_id, {}).update(seen)
    assert logged["chatcmpl-a"] == {
        "mode": "remote", "admission_s": 0.0078, "copy_s": 0.015, "prefill_compute_s": 1.7963,
        "in_worker_s": 1.83, "transfer_s": 0.005, "transport": "cuda-ipc",
        "prefill_compute_s_remote": 0.3,
    }  # fmt: skip
    records = [
        {"response_id": "chatcmpl-a", "is_warmup": False, "ttft_s": 1.86},
        {"response_id": "chatcmpl-b", "is_warmup": False, "ttft_s": 0.13},
        {"response_id": "chatcmpl-w", "is_warmup": True, "ttft_s": 9.0},
    ]
    summary = run.observe.server_summary(records, logged)
    assert summary["num_logged"] == 2
    assert summary["prefill_modes"] == {"remote": 1, "local": 1}
    assert summary["transports"] == {"cuda-ipc": 1}
    assert summary["stages_s"]["transfer_s"] == {"p50": 0.005, "p99": 0.005}
    # the client's TTFT less the worker's time, request by request: 0.03 and 0.01 s
    assert summary["stages_s"]["outside_worker_s"]["p50"] == pytest.approx(0.02)


def test_the_vocabulary_names_roles_and_words_then_numbers_every_other_id() -> None:
    vocab = model.vocabulary(10, ["time", "year", "time"])
    assert vocab == {
        "[UNK]": 0, "<|system|>": 1, "<|user|>": 2, "<|assistant|>": 3, "time": 4, "year": 5,
        "t6": 6, "t7": 7, "t8": 8, "t9": 9,
    }  # fmt: skip
    with pytest.raises(ValueError, match="do not fit"):
        model.vocabulary(5, ["time", "year"])


def test_the_tokenizer_gives_one_token_per_word_and_a_nonempty_word_per_token(
    tmp_path: Path,
) -> None:
    from kvrail.router.text.tokenizer import TextCodec

    model.write_tokenizer(tmp_path, 1000, lg.WORDS)
    codec = TextCodec.from_directory(tmp_path, "random")
    words = "time year people"
    ids = codec.chat_prompt([{"role": "user", "content": words}])
    assert len(ids) == len(words.split()) + 2  # <|user|> ... <|assistant|>
    assert codec.eos_token_ids == ()  # nothing ends a request before max_tokens
    detok = codec.detokenizer(ids)
    assert [detok.feed([i]) for i in (999, 998, 4)] == [" t999", " t998", " " + lg.WORDS[0]]


def test_the_llama3_8b_shape_has_its_eight_billion_parameters() -> None:
    shapes = model.weight_shapes(model.SHAPES["llama3-8b"])
    num_params = 0
    for _, dims in shapes:
        n = 1
        for d in dims:
            n *= d
        num_params += n
    assert num_params == 8_030_261_248
    assert len(shapes) == 2 + 9 * 32 + 1


def _point(sweep: str, rate: float, ttft_p99: float, itl_p99: float, errors: int = 0) -> Any:
    summary = {
        "num_errors": errors, "num_completed": 10 - errors, "arrival_rate_per_s": rate,
        "requests_per_s": rate, "output_tokens_per_s": 10.0,
        "ttft_s": {"p50": ttft_p99 / 2, "p99": ttft_p99},
        "itl_s": {"p50": itl_p99 / 2, "p99": itl_p99}, "tpot_s": {"p50": 0.01, "p99": 0.02},
        "goodput": {"slo": {"ttft_s": 2.0, "itl_s": 0.05}, "requests_per_s": rate,
                    "attainment": 1.0},
        "window_s": 10 / rate,
    }  # fmt: skip
    requests = [{"is_warmup": False, "error": "boom" if i < errors else None, "ttft_s": ttft_p99,
                 "tpot_s": 0.01} for i in range(10)]  # fmt: skip
    return {"sweep": sweep, "point": {"rate": rate}, "summary": summary, "requests": requests}


def test_goodput_by_tpot_counts_what_vllm_bench_serve_counts() -> None:
    point = _point("chat", 2.0, 1.0, 0.5)  # ITL p99 far out: the sweep's own goodput says 0
    requests = point["requests"]
    requests[0]["tpot_s"] = 0.06  # a mean gap over 50 ms
    requests[1]["ttft_s"] = 2.5  # a first token after 2 s
    requests[2]["error"] = "timeout"
    requests.append({"is_warmup": True, "error": None, "ttft_s": 0.1, "tpot_s": 0.01})
    assert report.goodput_by_tpot(point) == pytest.approx(7 / 5.0)  # 7 good in a 5 s window


def test_the_highest_rate_within_the_slos_is_reported_per_setup() -> None:
    result = {"setups": [
        {"setup": "colocated", "points": [_point("long", 0.5, 1.0, 0.04),
                                          _point("long", 1.0, 1.5, 0.09)]},
        {"setup": "disaggregated", "points": [_point("long", 0.5, 1.0, 0.02),
                                              _point("long", 1.0, 1.9, 0.03),
                                              _point("long", 2.0, 1.0, 0.03, errors=1)]},
    ]}  # fmt: skip
    assert report.best_rates(result, "long") == {"colocated": 0.5, "disaggregated": 1.0}
    assert "| disaggregated | 2 (2.00) | 9 / 1 |" in report.markdown(result)


def test_merging_runs_keeps_every_setup_and_each_runs_metadata() -> None:
    a = {"command": "a", "setups": [{"setup": "colocated", "points": []}]}
    b = {"command": "b", "setups": [{"setup": "disaggregated", "points": []}]}
    merged = report.merge([a, b])
    assert [s["setup"] for s in merged["setups"]] == ["colocated", "disaggregated"]
    assert [r["command"] for r in merged["runs"]] == ["a", "b"]


def test_points_whose_load_generator_was_cpu_bound_are_named() -> None:
    busy, calm = _point("chat", 2.0, 1.0, 0.04), _point("chat", 4.0, 1.0, 0.04)
    busy["client"] = {"processes": 1, "busiest_cpu_fraction": 0.93, "bound": True}
    calm["client"] = {"processes": 4, "busiest_cpu_fraction": 0.35, "bound": False}
    result = {"setups": [{"setup": "colocated", "points": [busy, calm]}]}
    text = report.markdown(result)
    assert "- client-bound: colocated at 2 req/s (its busiest load generator process 93%" in text
    assert "at 4 req/s" not in text


def test_routers_and_client_processes_are_checked() -> None:
    assert run.parse_args([]).client_processes == 4  # a GPU machine's default
    assert run.parse_args(["--cpu"]).client_processes == 1
    for bad in (["--routers", "0"], ["--routers", "3", "--client-processes", "2"]):
        with pytest.raises(SystemExit):
            run.parse_args(bad)


def test_the_stage_table_keeps_each_workload_of_a_rate_apart(tmp_path: Path) -> None:
    stages: Any = load_script("kvrail_bench_sweep_stages", SWEEP / "stages.py")

    def point(sweep: str, ttft_s: float, copy_s: float) -> dict[str, Any]:
        return {
            "label": "poisson 16/s", "sweep": sweep, "point": {"rate": 16.0},
            "summary": {"ttft_s": {"p50": ttft_s}},
            "servers": {"stages_s": {"copy_s": {"p50": copy_s}, "cached_tokens": {"p50": 0}}},
        }  # fmt: skip

    for i, (chat, long) in enumerate(((0.080, 0.050), (0.070, 0.054))):
        points = [point("chat", chat, 0.004), point("long", long, 0.005)]
        run_json = {"setups": [{"setup": "disaggregated", "points": points}]}
        (tmp_path / f"run-{i}.json").write_text(json.dumps(run_json))
    table = stages.collect(sorted(tmp_path.glob("*.json")))
    assert table[("disaggregated", "chat", 16.0)]["TTFT"] == pytest.approx([80.0, 70.0])
    assert table[("disaggregated", "long", 16.0)]["TTFT"] == pytest.approx([50.0, 54.0])
    assert table[("disaggregated", "long", 16.0)]["copy_s"] == pytest.approx([5.0, 5.0])
    assert "cached_tokens" not in table[("disaggregated", "chat", 16.0)]
    assert "| disaggregated | long | 16 | TTFT | 50.0, 54.0 | 52.0 |" in stages.markdown(table)
