"""What a hostile or broken grammar costs, per library: the error (or not), the time to compile
and to the first mask, the peak memory, and whether the process survives; and what bounding a
compile takes (abandoning a thread vs killing a process).

    /tmp/gvenv/bin/python bench/studies/grammar/hostile.py \
        | tee bench/studies/grammar/hostile.txt

Libraries: xgrammar as vLLM runs it, `xgrammar-dyn` (its `enable_dynamic_compilation`: masks
built on first use, so a case's cost can move from the compile into the fills of the walk; the
`mask s` column is the whole walk and `worst` its slowest fill), and llguidance.

Each library runs in a worker process (this script with `--worker`), one case at a time: the
worker compiles the case (xgrammar `compile_*`; llguidance `grammar_from_*` + `LLMatcher`),
then makes a matcher and walks a few tokens of a prefix that the schema allows (filling the
mask before each), or fills just the first mask. The parent
kills a worker that passes `--timeout` seconds (and starts a new one for the next case), so a
hang or a crash costs only its case. Peak memory is the worker's high-water mark during the
case above its resident size before it (VmHWM reset through /proc/self/clear_refs). SmolLM2's
tokenizer (49,152 tokens) only.

The last part runs ABANDONED (a case slow for xgrammar) in a thread, gives up on it after 1 s as
an event loop's `wait_for` would, and reports how long the abandoned compile keeps running.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any

from workload import clean_error, machine_line, versions

NESTING = 10_000
ABANDONED = "200 KB: 2.5k optional properties"


def _deep_object(depth: int) -> str:
    return '{"type":"object","properties":{"a":' * depth + '{"type":"integer"}' + "}}" * depth


def _deep_array(depth: int) -> str:
    return '{"type":"array","items":' * depth + '{"type":"integer"}' + "}" * depth


def _wide_object(target_bytes: int, *, required: bool) -> str:
    parts, names, size, i = [], [], 0, 0
    while size < target_bytes:
        part = f'"field_{i:07d}":{{"type":"string","description":"field number {i}"}}'
        parts.append(part)
        names.append(f'"field_{i:07d}"')
        size += len(part) + 14
        i += 1
    tail = ',"required":[' + ",".join(names) + "]" if required else ""
    return '{"type":"object","properties":{' + ",".join(parts) + "}" + tail + "}"


def _big_enum(target_bytes: int) -> str:
    values = [f'"value-{i:08d}"' for i in range(target_bytes // 17)]
    return '{"type":"string","enum":[' + ",".join(values) + "]}"


DEEP = '{"a": ' * 8
WIDE = '{"field_0000000": "x", "field_0000001": "y", "field_0000002": "z"'

CASES: dict[str, tuple[str, Callable[[], Any], str]] = {
    # name: (kind, spec factory, a sample to walk: "" for none)
    "dangling $ref": (
        "json_schema",
        lambda: {
            "type": "object",
            "properties": {"a": {"$ref": "#/$defs/Missing"}},
            "required": ["a"],
        },
        "",
    ),
    "remote $ref (http URL)": (
        "json_schema",
        lambda: {
            "type": "object",
            "properties": {"a": {"$ref": "https://example.com/schema.json"}},
        },
        "",
    ),
    "invalid: type 'nope'": ("json_schema", lambda: {"type": "nope"}, ""),
    "invalid: not JSON": ("json_schema", lambda: '{"type": "object", ', ""),
    "invalid: minLength > maxLength": (
        "json_schema",
        lambda: {"type": "string", "minLength": 5, "maxLength": 2},
        "",
    ),
    "invalid: minimum > maximum": (
        "json_schema",
        lambda: {"type": "integer", "minimum": 10, "maximum": 1},
        "",
    ),
    "recursive $ref (valid tree)": (
        "json_schema",
        lambda: {
            "$defs": {
                "node": {
                    "type": "object",
                    "properties": {
                        "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}
                    },
                }
            },
            "$ref": "#/$defs/node",
        },
        '{"children": [{"children": []}]}',
    ),
    "nested objects 50 deep": ("json_schema", lambda: _deep_object(50), DEEP),
    "nested objects 300 deep": ("json_schema", lambda: _deep_object(300), DEEP),
    "nested objects 1,000 deep": ("json_schema", lambda: _deep_object(1000), DEEP),
    f"nested objects {NESTING:,} deep": ("json_schema", lambda: _deep_object(NESTING), ""),
    f"nested arrays {NESTING:,} deep": ("json_schema", lambda: _deep_array(NESTING), ""),
    "200 KB: 2.5k optional properties": (
        "json_schema",
        lambda: _wide_object(200_000, required=False),
        WIDE,
    ),
    "200 KB: 2.5k required properties": (
        "json_schema",
        lambda: _wide_object(200_000, required=True),
        WIDE,
    ),
    "1 MB: 12k optional properties": (
        "json_schema",
        lambda: _wide_object(1_000_000, required=False),
        WIDE,
    ),
    "10 MB: 125k optional properties": (
        "json_schema",
        lambda: _wide_object(10_000_000, required=False),
        WIDE,
    ),
    "10 MB: enum of 590k strings": (
        "json_schema",
        lambda: _big_enum(10_000_000),
        '"value-00012345"',
    ),
    "array minItems 10,000 of objects": (
        "json_schema",
        lambda: {
            "type": "array",
            "minItems": 10_000,
            "items": {"type": "object", "properties": {"x": {"type": "integer"}}},
        },
        '[{"x": 1}, {"x": 2}, {"x": 3}',
    ),
    "string minLength 1,000,000": (
        "json_schema",
        lambda: {"type": "string", "minLength": 1_000_000},
        '"' + "a" * 64,
    ),
    "regex (a+)+$": ("regex", lambda: "(a+)+$", "a" * 64),
    "schema pattern (a+)+$": (
        "json_schema",
        lambda: {"type": "string", "pattern": "^(a+)+$"},
        '"' + "a" * 64 + '"',
    ),
    "regex DFA blow-up (a|b)*a(a|b){20}": ("regex", lambda: "(a|b)*a(a|b){20}", "ab" * 32),
    "regex nested counts (x{1,1000}){1,1000}": ("regex", lambda: "(x{1,1000}){1,1000}", "x" * 64),
    "regex invalid: unclosed (": ("regex", lambda: "(abc", ""),
}


# --- the worker ---------------------------------------------------------------------------------


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1]) * 1024
    return 0


def _walk(lib: Any, matcher: Any, tokens: list[int]) -> tuple[int, float]:
    """Fill and accept along `tokens`; how many were accepted and the slowest fill (ms)."""
    import torch

    bitmask = torch.full((1, (lib.vocab_size + 31) // 32), -1, dtype=torch.int32)
    worst = 0.0
    for n in range(len(tokens) + 1):
        start = time.perf_counter()
        lib.fill(matcher, bitmask, 0)
        worst = max(worst, time.perf_counter() - start)
        if n == len(tokens) or not lib.accept(matcher, tokens[n]):
            return n, worst * 1e3
    return len(tokens), worst * 1e3


def _error_of(lib: Any, matcher: Any) -> str:
    if lib.name == "llguidance" and matcher.is_error():
        return str(matcher.get_error())
    return ""


def run_case(lib: Any, tokenizer: Any, name: str) -> dict[str, Any]:
    kind, make, sample = CASES[name]
    spec = make()
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM
    rss = _status("VmRSS:")
    out: dict[str, Any] = {"spec_bytes": len(spec if isinstance(spec, str) else json.dumps(spec))}
    start, cpu = time.perf_counter(), time.process_time()
    try:
        compiled = lib.compile(kind, spec)
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
        compiled = None
    out["compile_s"] = time.perf_counter() - start
    out["compile_cpu_s"] = time.process_time() - cpu
    if compiled is not None:
        matcher = lib.matcher(compiled)
        tokens = tokenizer.encode(sample, add_special_tokens=False) if sample else []
        start = time.perf_counter()
        walked, worst = _walk(lib, matcher, tokens)
        out["mask_s"] = time.perf_counter() - start
        out["walked"] = f"{walked}/{len(tokens)}" if tokens else "-"
        out["worst_fill_ms"] = worst
        out["error"] = _error_of(lib, matcher)
    out["peak_mib"] = (_status("VmHWM:") - rss) / 2**20
    return out


def abandon(lib: Any, name: str, after: float, limit: float) -> dict[str, Any]:
    """Compile in a thread, stop waiting after `after` s, and see how long it runs on (up to
    `limit` s)."""
    kind, make, _ = CASES[name]
    spec = make()
    pool = ThreadPoolExecutor(1)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    future = pool.submit(lib.compile, kind, spec)
    ticks, lags = 0, []  # meanwhile, does the main thread (an event loop) still get to run?
    try:
        future.result(timeout=after)
        gave_up = False
    except FutureTimeout:
        gave_up = True
    except Exception:
        gave_up = False
    given_up_at = time.perf_counter() - wall0
    while not future.done() and time.perf_counter() - wall0 < limit:
        t = time.perf_counter()
        time.sleep(0.001)
        lags.append(time.perf_counter() - t - 0.001)
        ticks += 1
    finished_at = time.perf_counter() - wall0
    pool.shutdown(wait=False)
    return {
        "gave_up": gave_up,
        "given_up_at_s": given_up_at,
        "finished_at_s": finished_at,
        "cpu_s": time.process_time() - cpu0,
        "main_thread_max_lag_ms": max(lags, default=0.0) * 1e3,
        "outcome": "still running"
        if not future.done()
        else "error"
        if future.exception()
        else "compiled",
    }


def worker(library: str) -> None:
    from workload import LLGuidance, XGrammar, load_tokenizer

    start = time.perf_counter()
    tokenizer, vocab_size = load_tokenizer("smollm2")
    if library.startswith("xgrammar"):
        lib: Any = XGrammar(tokenizer, vocab_size, dynamic=library == "xgrammar-dyn")
    else:
        lib = LLGuidance(tokenizer, vocab_size)
    print(json.dumps({"ready_s": time.perf_counter() - start}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        if "abandon" in request:
            result = abandon(lib, request["abandon"], request["after"], request["limit"])
        else:
            result = run_case(lib, tokenizer, request["case"])
        print(json.dumps(result), flush=True)


# --- the parent ---------------------------------------------------------------------------------


class Worker:
    def __init__(self, library: str) -> None:
        self.started = time.perf_counter()
        env = dict(os.environ, TOKENIZERS_PARALLELISM="false", PYTHONWARNINGS="ignore")
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--worker", library],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        ready = self.read(300)
        assert ready is not None, "worker did not start"
        self.start_s = time.perf_counter() - self.started

    def read(self, timeout: float) -> dict[str, Any] | None:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            return None
        line = self.proc.stdout.readline()
        return json.loads(line) if line else None

    def ask(self, request: dict[str, Any], timeout: float) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        start, cpu = time.perf_counter(), _proc_cpu(self.proc.pid)
        answer = self.read(timeout)
        if answer is not None:
            return answer
        elapsed = time.perf_counter() - start
        if self.proc.poll() is None:
            peak = _proc_status(self.proc.pid, "VmHWM:")
            used = _proc_cpu(self.proc.pid) - cpu
            self.kill()
            return {"killed_after_s": elapsed, "cpu_s": used, "peak_total_mib": peak / 2**20}
        return {"died": self.proc.returncode, "after_s": elapsed}

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def _proc_cpu(pid: int) -> float:
    """A process's CPU time so far (user + system), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _proc_status(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1]) * 1024
    return 0


def _clean(error: str) -> str:
    """The error's gist and its full length (xgrammar's can echo the whole schema)."""
    return f"[{len(error):,} B] " + clean_error(error)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker")
    parser.add_argument("--timeout", type=float, default=30.0)
    parser.add_argument("--libraries", default="xgrammar,xgrammar-dyn,llguidance")
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return
    print(machine_line())
    print(versions())
    print(f"timeout per case: {args.timeout:.0f} s; tokenizer: SmolLM2 (49,152 tokens)")
    for library in args.libraries.split(","):
        w = Worker(library)
        print(f"\n== {library} (worker start, imports and tokenizer: {w.start_s:.1f} s)")
        print(f"{'case':42s} {'spec':>8s} {'compile s':>9s} {'cpu s':>6s} {'mask s':>8s} "
              f"{'worst':>6s} {'walked':>7s} {'peak MiB':>8s}  outcome")  # fmt: skip
        for name in CASES:
            r = w.ask({"case": name}, args.timeout)
            if "killed_after_s" in r or "died" in r:
                if "died" in r:
                    outcome = f"worker died (exit {r['died']}) after {r['after_s']:.1f} s"
                else:
                    outcome = (
                        f"no answer in {r['killed_after_s']:.0f} s ({r['cpu_s']:.0f} s CPU): "
                        f"killed (worker peak {r['peak_total_mib']:.0f} MiB in all)"
                    )
                print(f"{name:42s} {'':>8s} {'':>9s} {'':>6s} {'':>8s} {'':>6s} {'':>7s} {'':>8s}  "
                      f"{outcome}")  # fmt: skip
                w = Worker(library)
                continue
            size = f"{r['spec_bytes'] / 1e6:.1f}MB" if r["spec_bytes"] > 1e5 else r["spec_bytes"]
            mask = f"{r['mask_s']:.3f}" if "mask_s" in r else "-"
            worst = f"{r['worst_fill_ms'] / 1e3:.3f}" if "worst_fill_ms" in r else "-"
            outcome = ("ERROR " + _clean(r["error"])) if r["error"] else "compiled"
            print(
                f"{name:42s} {size!s:>8s} {r['compile_s']:9.3f} {r['compile_cpu_s']:6.2f} "
                f"{mask:>8s} {worst:>6s} {r.get('walked', '-'):>7s} {r['peak_mib']:8.1f}  "
                f"{outcome}",
                flush=True,
            )
        w.close()

    print("\nAbandoning a compile: a thread runs it, the caller stops waiting after 1 s")
    for library in args.libraries.split(","):
        name = ABANDONED
        w = Worker(library)
        r = w.ask({"abandon": name, "after": 1.0, "limit": args.timeout}, args.timeout + 10)
        if "gave_up" not in r:
            print(f"{library}: {name}: no answer in {args.timeout + 10:.0f} s; worker killed")
            continue
        print(
            f"{library}: {name}: gave up at {r['given_up_at_s']:.1f} s: {r['gave_up']}; the "
            f"thread ran on to {r['finished_at_s']:.1f} s ({r['outcome']}), {r['cpu_s']:.1f} s "
            f"CPU; main thread's worst wake-up lag meanwhile {r['main_thread_max_lag_ms']:.1f} ms"
        )
        w.kill()  # an abandoned thread would hold up its exit

    print("\nThe request body itself (what the router's json.loads does before any library):")
    for label, text in (
        (f"schema nested {NESTING:,} deep", _deep_object(NESTING)),
        ("10 MB schema", _wide_object(10_000_000, required=False)),
    ):
        body = '{"response_format":{"type":"json_schema","json_schema":{"schema":' + text + "}}}"
        start = time.perf_counter()
        try:
            json.loads(body)
            outcome = "parsed"
        except RecursionError as exc:
            outcome = f"RecursionError: {exc}"
        print(f"{label}: json.loads {time.perf_counter() - start:.3f} s: {outcome}")


if __name__ == "__main__":
    main()
