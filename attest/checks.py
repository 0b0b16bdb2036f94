"""The verdicts of attest/verify: each check PASSes, FAILs or is SKIPped, and says why.

One `Checks` per run collects them in order. In text mode each verdict is printed as it
is made (`PASS name`, `FAIL name: reason`, `SKIP name: reason`), one line each; with
--json nothing is printed until the end, then one document (`document()`). Notes
(the TCB status, the gateway's version) are lines in text mode and a list in JSON.
"""

from __future__ import annotations

import json
import sys

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_UNVERIFIED = 0, 1, 2, 4
PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"


class Checks:
    def __init__(self, as_json: bool = False, out=None):
        self.as_json = as_json
        self.out = out or sys.stdout
        self.results: list[dict] = []
        self.notes: list[str] = []
        self.timed_out = False

    def report(self, name: str, reason: str | None = None, skip: bool = False, **values) -> None:
        """PASS when `reason` is None; else FAIL, or SKIP when `skip`. `values`: what was compared."""
        result = PASS if reason is None else SKIP if skip else FAIL
        if reason is not None:
            reason = " ".join(reason.split())  # one line, whatever a library or a server said
        self.results.append({"name": name, "result": result, "reason": reason, "values": values})
        if not self.as_json:
            print(f"{result} {name}" + (f": {reason}" if reason is not None else ""), file=self.out, flush=True)

    def note(self, line: str) -> None:
        self.notes.append(line)
        if not self.as_json:
            print(line, file=self.out, flush=True)

    @property
    def failed(self) -> bool:
        return any(r["result"] == FAIL for r in self.results)

    @property
    def skipped(self) -> bool:
        return any(r["result"] == SKIP for r in self.results)

    def document(self, exit_code: int, **extra) -> str:
        verdict = {
            EXIT_OK: "UNVERIFIED" if self.skipped else "PASS",
            EXIT_FAILED: "FAIL",
            EXIT_UNVERIFIED: "UNVERIFIED",
        }.get(exit_code, "ERROR")
        return json.dumps(
            {"verdict": verdict, "exit": exit_code, "checks": self.results, "notes": self.notes, **extra}, indent=2
        )
