"""Checks and their verdicts. A check passes by returning; it ends any other way by raising a
Verdict that carries the reason and the exchange that shows it (its reproducer)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NoReturn

if TYPE_CHECKING:
    from tailrace.check.client import Exchange

PASS, FAIL, IGNORED, SKIP = "PASS", "FAIL", "IGNORED", "SKIP"
STATUSES = (PASS, FAIL, IGNORED, SKIP)
GROUPS = ("framing", "equivalence", "offsets", "stop", "utf8", "usage", "n", "tools", "errors")  # in report order


class Verdict(Exception):
    def __init__(self, status: str, reason: str, exchange: Exchange | None = None) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason
        self.exchange = exchange


def fail(reason: str, exchange: Exchange | None = None) -> NoReturn:
    raise Verdict(FAIL, reason, exchange)


def ignore(reason: str, exchange: Exchange | None = None) -> NoReturn:
    """Differs by design, not a bug: a vLLM-only field not served, a seed not honoured."""
    raise Verdict(IGNORED, reason, exchange)


def skip(reason: str) -> NoReturn:
    """Could not be tried on this server or model."""
    raise Verdict(SKIP, reason)


@dataclass(frozen=True, slots=True)
class Result:
    group: str
    name: str
    rule: str
    status: str
    reason: str = ""
    reproducer: str = ""  # a curl command line, for failures
    seconds: float = 0.0
