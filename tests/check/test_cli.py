"""`tailrace check` on the command line: its exit code, its groups, its files."""

from __future__ import annotations

import json

from tailrace.cli import main

from .broken_server import API_KEY
from .conftest import bug_url


def test_exit_code_is_1_when_a_check_fails(fixture_url: str):
    argv = ["check", "--base-url", bug_url(fixture_url, "no_done"), "--api-key", API_KEY, "--only", "framing"]
    assert main(argv) == 1


def test_exit_code_is_0_when_none_fails(fixture_url: str):
    argv = ["check", "--base-url", bug_url(fixture_url, "none"), "--api-key", API_KEY, "--only", "framing,errors"]
    assert main(argv) == 0


def test_the_summary_line_ends_the_report(fixture_url: str, capsys):
    main(["check", "--base-url", bug_url(fixture_url, "none"), "--api-key", API_KEY, "--only", "framing"])
    assert capsys.readouterr().out.rstrip().splitlines()[-1] == "5 passed, 0 failed, 0 ignored, 0 skipped"


def test_skip_leaves_a_group_out(fixture_url: str, tmp_path):
    out = tmp_path / "r.json"
    main(["check", "--base-url", bug_url(fixture_url, "none"), "--api-key", API_KEY, "--only", "framing,errors",
          "--skip", "errors", "--json", str(out)])
    assert {r["group"] for r in json.loads(out.read_text())["results"]} == {"framing"}


def test_an_unknown_group_is_refused():
    assert main(["check", "--base-url", "http://127.0.0.1:9", "--only", "nonsense"]) == 2



def test_the_group_list_names_every_group_module_in_order():
    from tailrace.check.results import GROUPS
    from tailrace.check.runner import GROUP_MODULES

    assert tuple(module.GROUP for module in GROUP_MODULES) == GROUPS
