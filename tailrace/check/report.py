"""The verdicts as a terminal table with a curl reproducer per failure, and as JSON and JUnit XML for CI."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import asdict
from pathlib import Path

from tailrace.check.results import FAIL, IGNORED, PASS, SKIP, Result


def summary(results: list[Result]) -> str:
    counts = Counter(result.status for result in results)
    return (f"{counts[PASS]} passed, {counts[FAIL]} failed, {counts[IGNORED]} ignored, "
            f"{counts[SKIP]} skipped")


def table(results: list[Result], base_url: str, model: str) -> str:
    lines = [f"tailrace check {base_url} (model {model})"]
    width = max((len(result.name) for result in results), default=0)
    group = None
    for result in results:
        if result.group != group:
            group = result.group
            lines += ["", group]
        line = f"  {result.status:<8} {result.name:<{width}} {result.rule}"
        lines.append(line)
        if result.reason:
            lines.append(f"  {'':<8} {'':<{width}} -> {result.reason}")
    failures = [result for result in results if result.status == FAIL and result.reproducer]
    if failures:
        lines += ["", "reproducers"]
        for result in failures:
            lines += [f"  {result.group} / {result.name}:", f"    {result.reproducer}"]
    lines += ["", summary(results)]
    return "\n".join(lines)


def write_json(results: list[Result], path: str, base_url: str, model: str) -> None:
    report = {"base_url": base_url, "model": model, "summary": summary(results),
              "results": [asdict(result) for result in results]}
    Path(path).write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n")


def write_junit(results: list[Result], path: str) -> None:
    """One testsuite per group; FAIL is a failure, SKIP and IGNORED are skipped with their reason."""
    suites = ET.Element("testsuites", name="tailrace check")
    for group in dict.fromkeys(result.group for result in results):
        members = [result for result in results if result.group == group]
        counts = Counter(result.status for result in members)
        suite = ET.SubElement(suites, "testsuite", name=group, tests=str(len(members)), failures=str(counts[FAIL]),
                              skipped=str(counts[SKIP] + counts[IGNORED]))
        for result in members:
            case = ET.SubElement(suite, "testcase", classname=group, name=result.name,
                                 time=f"{result.seconds:.3f}")
            if result.status == FAIL:
                failure = ET.SubElement(case, "failure", message=result.reason)
                failure.text = f"{result.rule}\n{result.reason}\n{result.reproducer}"
            elif result.status in (SKIP, IGNORED):
                ET.SubElement(case, "skipped", message=f"{result.status}: {result.reason}")
    ET.ElementTree(suites).write(path, encoding="utf-8", xml_declaration=True)
