"""Which checks run, in what order, and each one's verdict."""

from __future__ import annotations

import time

from tailrace.check import choices, equivalence, errors, framing, offsets, stops, tools, usage, utf8
from tailrace.check.results import FAIL, GROUPS, PASS, Result, Verdict
from tailrace.check.session import Check, Session

GROUP_MODULES = (framing, equivalence, offsets, stops, utf8, usage, choices, tools, errors)  # as results.GROUPS
# These look at every stream the others made, so they run after them, framing last (and report in GROUPS order).
RUN_LAST = (usage.GROUP, framing.GROUP)


def select(only: list[str] | None, skipped: list[str] | None) -> list[Check]:
    unknown = {*(only or []), *(skipped or [])} - set(GROUPS)
    if unknown:
        raise ValueError(f"unknown check groups {sorted(unknown)}; the groups are {', '.join(GROUPS)}")
    return [check for module in GROUP_MODULES for check in module.CHECKS
            if (not only or check.group in only) and check.group not in (skipped or [])]


def run_one(session: Session, check: Check) -> Result:
    started = time.monotonic()
    status, reason, reproducer = PASS, "", ""
    try:
        check.run(session)
    except Verdict as verdict:
        status, reason = verdict.status, verdict.reason
        reproducer = session.client.curl(verdict.exchange) if verdict.exchange is not None else ""
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:  # a malformed answer
        status, reason = FAIL, f"the answer could not be read: {type(exc).__name__}: {exc}"
    return Result(check.group, check.name, check.rule, status, reason, reproducer, time.monotonic() - started)


def run_checks(session: Session, checks: list[Check]) -> list[Result]:
    ordered = sorted(checks, key=lambda check: RUN_LAST.index(check.group) + 1 if check.group in RUN_LAST else 0)
    results = {check: run_one(session, check) for check in ordered}
    return [results[check] for check in checks]
