"""Results of a conformance run: one outcome per check, a summary, text and JSON forms."""

from __future__ import annotations

import enum
import json
from dataclasses import asdict, dataclass, field


class Outcome(enum.StrEnum):
    PASS = "PASS"
    FAIL = "FAIL"
    SKIP = "SKIP"  # the server does not offer what the check needs (said why); not a failure


@dataclass
class CheckResult:
    name: str
    outcome: Outcome
    detail: str = ""  # why it failed or was skipped; what was seen when it passed
    seconds: float = 0.0


@dataclass
class Report:
    kind: str  # "env" or "policy"
    target: str
    results: list[CheckResult] = field(default_factory=list)

    @property
    def failed(self) -> list[CheckResult]:
        return [result for result in self.results if result.outcome == Outcome.FAIL]

    @property
    def ok(self) -> bool:
        return not self.failed

    def summary(self) -> str:
        counts = {outcome: sum(r.outcome == outcome for r in self.results) for outcome in Outcome}
        verdict = "conforms" if self.ok else "does NOT conform"
        return (f"{self.kind} server {self.target} {verdict}: {counts[Outcome.PASS]} passed, "
                f"{counts[Outcome.FAIL]} failed, {counts[Outcome.SKIP]} skipped")

    def render(self) -> str:
        width = max((len(result.name) for result in self.results), default=0)
        lines = [f"{result.outcome.value:<4}  {result.name:<{width}}  {result.detail}".rstrip()
                 for result in self.results]
        return "\n".join([*lines, self.summary()])

    def to_json(self) -> str:
        return json.dumps({"kind": self.kind, "target": self.target, "ok": self.ok, "summary": self.summary(),
                           "checks": [asdict(result) for result in self.results]}, indent=2)
