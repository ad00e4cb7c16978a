"""The table of ``tests/gpu/run_all.sh``: one row a check, from what ``lanes.sh`` printed
(``lane I rc=RC Ns :: CMD #NAME :: LAST LINE``, the check's JSON report being its last
line) and the skips. Prints a Markdown table, then one JSON line.

    python3 tests/gpu/table.py lanes.txt [total seconds]
"""

from __future__ import annotations

import json
import re
import sys

LINE = re.compile(r"^lane \d+ rc=(\d+) (\d+)s :: (.*?) #(\S+) :: (.*)$")


def _max_error(report: dict) -> float | None:
    errors = report.get("max_rel_err")
    if isinstance(errors, dict) and errors:
        return max(v for v in errors.values() if isinstance(v, int | float))
    return errors if isinstance(errors, int | float) else None


def rows(text: str) -> list[dict]:
    """One dict a check: name, parallelism, result, max error, seconds, note."""
    out = []
    for line in text.splitlines():
        if line.startswith("skipped :: "):
            name, why = line[len("skipped :: ") :].split("|", 1)
            out.append({"check": name, "result": "not run", "note": why})
            continue
        m = LINE.match(line)
        if not m:
            continue
        rc, secs, name, last = int(m[1]), int(m[2]), m[4], m[5]
        try:
            report = json.loads(last)
        except ValueError:
            report = {}
        par = f"tp{report.get('tp', 1)} pp{report.get('pp', 1)}" if report else ""
        if rc == 124:
            result, note = "TIMEOUT", last[-160:]
        elif report.get("ok") and rc == 0:
            result, note = "pass", ""
        else:
            result = "FAIL"
            note = "; ".join(map(str, report.get("problems", [])))[:160] if report else last[-160:]
        err = _max_error(report)
        out.append(
            {
                "check": name,
                "parallel": par,
                "result": result,
                "max_rel_err": None if err is None else round(err, 5),
                "seconds": secs,
                "engine_start_s": report.get("engine_start_s"),
                "note": note,
            }
        )
    return out


def main() -> int:
    with open(sys.argv[1]) as f:
        text = f.read()
    total = int(sys.argv[2]) if len(sys.argv) > 2 else None
    table = rows(text)
    print("| check | parallel | result | max rel err | s | note |")
    print("|---|---|---|---|---|---|")
    for r in table:
        print(
            f"| {r['check']} | {r.get('parallel', '')} | {r['result']} | "
            f"{r.get('max_rel_err', '')} | {r.get('seconds', '')} | {r.get('note', '')} |"
        )
    passed = sum(r["result"] == "pass" for r in table)
    ran = sum(r["result"] != "not run" for r in table)
    print(json.dumps({"gpu_checks": len(table), "ran": ran, "passed": passed, "total_s": total}))
    return 0 if passed == ran else 1


if __name__ == "__main__":
    sys.exit(main())
