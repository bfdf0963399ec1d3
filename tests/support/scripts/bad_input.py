"""Run many bad `titan fit` command lines in one process (one Lightning import) and record how each fails.

python tests/support/scripts/bad_input.py CASES.json OUT.json

CASES.json: [[name, [cli args...]], ...]. OUT.json: {name: {"error": type, "message": str,
"seconds": float}}, or {"error": null} for a case that did not fail. Every case must fail before any
rank starts: should one get as far as starting ranks, they re-run this script, and the guard below makes
them exit at once with code 97, which fails the job.
"""

import json
import os
import sys
import time

if os.environ.get("LOCAL_RANK", "0") != "0":  # a rank was started: the checks came too late
    sys.exit(97)

from lightning_titan.cli import main  # noqa: E402


def run(args: list[str]) -> dict:
    start = time.perf_counter()
    try:
        main(args)
    except BaseException as e:  # noqa: BLE001 - the point is to record it
        return {
            "error": type(e).__name__,
            "message": str(e),
            "seconds": time.perf_counter() - start,
        }
    return {"error": None, "message": "", "seconds": time.perf_counter() - start}


if __name__ == "__main__":
    cases = json.loads(open(sys.argv[1]).read())
    results = {name: run(args) for name, args in cases}
    with open(sys.argv[2], "w") as f:
        json.dump(results, f, indent=1)
