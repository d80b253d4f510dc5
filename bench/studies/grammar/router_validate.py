"""What kvrail's router could check before a request reaches a worker: llguidance's grammar
validation needs neither torch nor a tokenizer (xgrammar imports torch and transformers, which the
router never imports). For each of hostile.py's cases: the time, the peak memory growth and the
message of `grammar_from_*` + `LLMatcher.validate_grammar(grammar)`, one case after another in
this process (torch is checked to stay unimported).

    /tmp/gvenv/bin/python bench/studies/grammar/router_validate.py \
        | tee bench/studies/grammar/router_validate.txt
"""

from __future__ import annotations

import json
import resource
import sys
import time

import llguidance
from hostile import CASES
from workload import clean_error, machine_line


def grammar_of(kind: str, spec: object) -> str:
    m = llguidance.LLMatcher
    if kind == "json_schema":
        return m.grammar_from_json_schema(spec if isinstance(spec, str) else json.dumps(spec))
    return m.grammar_from_regex(str(spec))


def main() -> None:
    print(machine_line())
    print(f"llguidance {llguidance.__version__}")
    print(f"{'case':42s} {'s':>7s} {'+MiB':>6s}  result")
    for name, (kind, make, _) in CASES.items():
        spec = make()
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        start = time.perf_counter()
        try:
            message = llguidance.LLMatcher.validate_grammar(grammar_of(kind, spec))
        except ValueError as exc:
            message = str(exc)
        took = time.perf_counter() - start
        grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
        result = f"400: {clean_error(message, 90)}" if message else "valid"
        print(f"{name:42s} {took:7.3f} {grown:6.0f}  {result}", flush=True)
    print(f"torch imported: {'torch' in sys.modules}")


if __name__ == "__main__":
    main()
