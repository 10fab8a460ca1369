"""Fuzz the server's own OpenAPI spec with schemathesis: every operation, many generated cases
(schema-valid and, in negative mode, schema-violating bodies, paths and queries), against a real uvicorn on 127.0.0.1 with
the scripted models. Checks: no 5xx (``not_a_server_error``) and every response conforms to the
published schema (``response_schema_conformance``). Prints the number of cases and failures.

    $ python benchmarks/schemathesis_fuzz.py --examples 200
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import schemathesis  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402
from schemathesis.generation import GenerationMode  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import response_schema_conformance  # noqa: E402
from server_fixtures import live_server  # noqa: E402
from test_server_schemathesis import fuzz_app  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", type=int, default=200, help="generated cases per operation (default 200)")
    args = parser.parse_args()
    app = fuzz_app()
    schema = schemathesis.openapi.from_dict(app.openapi())
    cases: Counter[str] = Counter()
    statuses: Counter[int] = Counter()
    failures: list[tuple[str, str]] = []
    started = time.perf_counter()
    with live_server(app) as srv:
        for result, mode in [(r, m) for r in schema.get_all_operations() for m in GenerationMode]:
            op = result.ok()
            label = f"{op.method.upper()} {op.path} [{mode.value}]"

            @given(case=op.as_strategy(generation_mode=mode))
            @settings(max_examples=args.examples, deadline=None, database=None,
                      suppress_health_check=list(HealthCheck))
            def run(case: Any) -> None:
                cases[label] += 1
                try:
                    response = case.call_and_validate(base_url=srv.url, timeout=30,
                                                      checks=[not_a_server_error, response_schema_conformance])
                    statuses[response.status_code] += 1
                except Exception as exc:  # noqa: BLE001 - counted and reported, the run goes on
                    failures.append((label, str(exc).splitlines()[0][:200]))

            try:
                run()
            except Unsatisfiable:
                pass  # negative mode on an operation with nothing to get wrong (no parameters, no body)
    elapsed = time.perf_counter() - started
    for label, n in sorted(cases.items()):
        print(f"  {label:58s} {n:5d} cases")
    operations = len({label.rsplit(" [", 1)[0] for label in cases})
    print(f"operations: {operations} ({len(cases)} operation x mode runs)  cases: {sum(cases.values())}  failures: {len(failures)}  "
          f"statuses: {dict(sorted(statuses.items()))}  time: {elapsed:.1f} s")
    for label, message in failures[:20]:
        print(f"FAIL {label}: {message}")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
