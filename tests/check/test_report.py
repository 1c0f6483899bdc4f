"""The report: the terminal table, the summary line, JSON and JUnit for CI."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

from tailrace.check.report import summary, table, write_json, write_junit
from tailrace.check.results import FAIL, IGNORED, PASS, SKIP, Result

RESULTS = [
    Result("framing", "[DONE] last", "`data: [DONE]` ends the stream", FAIL, "no `data: [DONE]`",
           "curl -sN http://x/v1/completions -d '{}'"),
    Result("framing", "data lines", "every line is data", PASS),
    Result("usage", "continuous usage", "vLLM's", IGNORED, "not served"),
    Result("utf8", "chat multi-byte text", "no U+FFFD", SKIP, "ASCII only"),
]


def test_the_summary_counts_each_verdict():
    assert summary(RESULTS) == "1 passed, 1 failed, 1 ignored, 1 skipped"


def test_the_table_shows_each_failure_with_its_curl_reproducer():
    assert "curl -sN http://x/v1/completions -d '{}'" in table(RESULTS, "http://x/v1", "m")


def test_the_table_groups_checks_under_their_group():
    lines = table(RESULTS, "http://x/v1", "m").splitlines()
    assert lines.index("framing") < lines.index("usage") < lines.index("utf8")


def test_json_holds_every_verdict(tmp_path):
    write_json(RESULTS, str(tmp_path / "r.json"), "http://x/v1", "m")
    report = json.loads((tmp_path / "r.json").read_text())
    assert [r["status"] for r in report["results"]] == [FAIL, PASS, IGNORED, SKIP]


def test_junit_marks_failures_and_skips_ignored_and_skipped(tmp_path):
    write_junit(RESULTS, str(tmp_path / "r.xml"))
    cases = ET.parse(tmp_path / "r.xml").getroot().iter("testcase")
    assert [next((child.tag for child in case), "passed") for case in cases] == ["failure", "passed", "skipped",
                                                                                "skipped"]
