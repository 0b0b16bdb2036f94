"""The verdicts of attest/verify: each check PASSes, FAILs or is SKIPped, and says why.

One `Checks` per run collects them in order. In text mode each check is printed as it
is made (`PASS name`, `FAIL name: reason`, `SKIP name: reason`; a PASS that leaves something
out says what: `PASS name: caveat`), one line each, and the run ends with one verdict line
(`verdict_line()`), whatever its exit status; with --json nothing is printed until the end,
then one document (`document()`) whose `verdict` is the same word. Notes (the TCB status,
the gateway's version) are lines in text mode and a list in JSON.
"""

from __future__ import annotations

import json
import sys

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_UNVERIFIED = 0, 1, 2, 4
EXIT_INTERRUPTED = 130
PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"
UNVERIFIED, ERROR = "UNVERIFIED", "ERROR"


class Checks:
    def __init__(self, as_json: bool = False, out=None):
        self.as_json = as_json
        self.out = out or sys.stdout
        self.results: list[dict] = []
        self.notes: list[str] = []
        self.timed_out = False
        self.caveat: str | None = None  # what even a PASS leaves out (plain http://), said in the verdict

    def report(
        self, name: str, reason: str | None = None, skip: bool = False, *, caveat: str | None = None, **values
    ) -> None:
        """PASS when `reason` is None; else FAIL, or SKIP when `skip`. `values`: what was compared.
        `caveat`, on a PASS: what the check did not cover (its `reason` in JSON)."""
        result = PASS if reason is None else SKIP if skip else FAIL
        said = reason if reason is not None else caveat
        if said is not None:
            said = " ".join(said.split())  # one line, whatever a library or a server said
        self.results.append({"name": name, "result": result, "reason": said, "values": values})
        if not self.as_json:
            print(f"{result} {name}" + (f": {said}" if said is not None else ""), file=self.out, flush=True)

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

    def names(self, result: str) -> list[str]:
        """The checks of this result, each once, in order."""
        return list(dict.fromkeys(r["name"] for r in self.results if r["result"] == result))

    def verdict(self, exit_code: int) -> str:
        """PASS, FAIL, UNVERIFIED or ERROR: what the run proved, from its exit status."""
        return {
            EXIT_OK: UNVERIFIED if self.skipped else PASS,
            EXIT_FAILED: FAIL,
            EXIT_UNVERIFIED: UNVERIFIED,
        }.get(exit_code, ERROR)

    def verdict_line(self, exit_code: int, error: str | None = None) -> str:
        """The last line of every text run: the verdict, why, and the exit status. `error`: why
        nothing was verified (bad usage, a local file)."""
        verdict, count = self.verdict(exit_code), len(self.results)
        if verdict == ERROR:
            why = f"nothing was verified: {' '.join((error or 'see above').split())}"
        elif verdict == FAIL:
            failed = self.names(FAIL)
            why = f"{len(failed)} of {count} checks FAILed ({', '.join(failed)})"
        elif verdict == UNVERIFIED:
            skipped = self.names(SKIP)
            why = f"{len(skipped)} of {count} checks SKIPped ({', '.join(skipped)}), the others PASSed: not proven"
            if exit_code == EXIT_OK:
                why += "; accepted with --accept-unverified"
        else:
            why = f"every check PASSed ({count} checks)"
        if self.caveat and verdict in (PASS, UNVERIFIED):
            why += f"; {self.caveat}"
        return f"verdict: {verdict}: {why}; exit {exit_code}"

    def document(self, exit_code: int, **extra) -> str:
        return json.dumps(
            {
                "verdict": self.verdict(exit_code),
                "exit": exit_code,
                "checks": self.results,
                "notes": self.notes,
                **extra,
            },
            indent=2,
        )
