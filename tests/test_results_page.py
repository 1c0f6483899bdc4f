"""bench/results_page.py: bench/README.md's tables come from bench/results/current.json alone."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import results_page  # noqa: E402  (bench/ is on sys.path only from here)
from results_page import BEGIN, END, Record  # noqa: E402

MACHINE = "Test CPU: AVX512"
PROSE_BEFORE = "# Figures\n\nHand-written prose.\n\n"
PROSE_AFTER = "\n\n## How to run\n\nMore prose.\n"


def record(concurrency: int = 1, tailrace: float = 100.0, peers: dict[str, float] | None = None,
           **fields: object) -> Record:
    return Record(**{"machine": MACHINE, "precision": "bfloat16", "shape": "SmolLM2-135M, 128 in / 128 out",
                     "concurrency": concurrency, "metric": "output tok/s", "tailrace": tailrace,
                     "peers": {"llama.cpp": 80.0} if peers is None else peers,
                     "command": "tailrace bench compare --shape smollm2-135m", "date": "2026-12-06",
                     "commit": "abc1234", "note": "", **fields})


def write(tmp_path: Path, records: list[Record]) -> tuple[Path, Path]:
    results, page = tmp_path / "current.json", tmp_path / "README.md"
    results_page.save(records, results)
    page.write_text(f"{PROSE_BEFORE}{BEGIN}\nstale table\n{END}{PROSE_AFTER}")
    return results, page


def table_rows(page: str) -> list[list[str]]:
    """The cells of the page's table rows, header and alignment row left out."""
    lines = [line for line in page.splitlines() if line.startswith("| ")]
    return [[c.strip() for c in line.strip("|").split(" | ")] for line in lines[2:]]


def run(*args: str | Path) -> int:
    return results_page.main([str(a) for a in args])


def test_render_writes_each_record_as_a_row_with_its_peers_and_ratios(tmp_path):
    results, page = write(tmp_path, [
        record(32, 400.0, {"llama.cpp": 200.0, "vLLM": 320.0}, note="vLLM failed 1 of 32 streams"),
        record(1, 1234.5, {"llama.cpp": 1000.0}, commit="not recorded"),
    ])
    assert run("render", "--results", results, "--page", page) == 0
    text = page.read_text()
    assert text.startswith(PROSE_BEFORE + BEGIN) and text.endswith(END + PROSE_AFTER)
    assert "stale table" not in text
    assert f"### {MACHINE}" in text
    header = next(line for line in text.splitlines() if line.startswith("| model shape"))
    assert "| llama.cpp | vLLM | tailrace / llama.cpp | tailrace / vLLM |" in header
    assert table_rows(text) == [  # sorted by concurrency; a peer not in the run is "-"
        ["SmolLM2-135M, 128 in / 128 out", "bfloat16", "1", "output tok/s", "1,234.5", "1,000.0", "-",
         "1.23x", "-", "2026-12-06", "not recorded", "1", ""],
        ["SmolLM2-135M, 128 in / 128 out", "bfloat16", "32", "output tok/s", "400.0", "200.0", "320.0",
         "2.00x", "1.25x", "2026-12-06", "abc1234", "1", "vLLM failed 1 of 32 streams"],
    ]
    assert "1. `tailrace bench compare --shape smollm2-135m`" in text  # the shared command, listed once


def test_a_pipe_in_a_note_does_not_split_the_cell(tmp_path):
    results, page = write(tmp_path, [record(note="Q4_0|Q8_0")])
    run("render", "--results", results, "--page", page)
    assert table_rows(page.read_text())[0][-1] == "Q4_0\\|Q8_0"


def test_add_replaces_the_row_with_the_same_key_and_appends_a_new_key(tmp_path):
    results, page = write(tmp_path, [record(1, 100.0), record(32, 300.0)])
    remeasured = tmp_path / "remeasured.json"
    remeasured.write_text(json.dumps([asdict(record(1, 111.0, {"llama.cpp": 90.0})),
                                      asdict(record(8, 222.0, {"llama.cpp": 150.0}))]))
    assert run("add", remeasured, "--results", results, "--page", page) == 0
    assert run("add", remeasured, "--results", results, "--page", page) == 0  # again: nothing appended twice
    stored = results_page.load(results)
    assert [(r.concurrency, r.tailrace, r.peers) for r in stored] == [
        (1, 111.0, {"llama.cpp": 90.0}), (32, 300.0, {"llama.cpp": 80.0}), (8, 222.0, {"llama.cpp": 150.0})]
    assert [row[2] for row in table_rows(page.read_text())] == ["1", "8", "32"]


def test_add_takes_one_record_object_too(tmp_path):
    results, page = write(tmp_path, [record(1, 100.0)])
    one = tmp_path / "one.json"
    one.write_text(json.dumps(asdict(record(1, 105.0))))
    run("add", one, "--results", results, "--page", page)
    assert [r.tailrace for r in results_page.load(results)] == [105.0]


def test_a_peer_the_new_run_did_not_measure_keeps_its_own_row():
    three_way = record(1, 50.0, {"llama.cpp": 40.0, "vLLM": 18.0})
    merged = results_page.merge([three_way], record(1, 55.0, {"llama.cpp": 33.0}))
    assert [(r.tailrace, r.peers) for r in merged] == [(50.0, {"vLLM": 18.0}), (55.0, {"llama.cpp": 33.0})]
    merged = results_page.merge(merged, record(1, 60.0, {"llama.cpp": 35.0, "vLLM": 20.0}))
    assert [(r.tailrace, r.peers) for r in merged] == [(60.0, {"llama.cpp": 35.0, "vLLM": 20.0})]


def test_check_fails_on_a_stale_page_and_passes_on_a_fresh_one(tmp_path, capsys):
    results, page = write(tmp_path, [record()])
    assert run("render", "--check", "--results", results, "--page", page) == 1
    assert "stale table" in page.read_text()  # --check writes nothing
    assert "bench/results_page.py render" in capsys.readouterr().err
    run("render", "--results", results, "--page", page)
    assert run("render", "--check", "--results", results, "--page", page) == 0
    page.write_text(page.read_text().replace("100.0", "101.0"))  # a figure edited by hand
    assert run("--check", "--results", results, "--page", page) == 1


def test_a_record_with_a_missing_or_unknown_field_is_refused():
    with pytest.raises(ValueError, match="record 0"):
        results_page.parse_records({"machine": MACHINE})
    with pytest.raises(ValueError, match="record 1"):
        results_page.parse_records([asdict(record()), {**asdict(record()), "speed": 1}])


def test_a_page_without_markers_is_refused():
    with pytest.raises(ValueError, match="results:begin"):
        results_page.render_page("# no markers\n", [record()])


def test_the_committed_page_is_what_render_writes_from_the_committed_records():
    page = results_page.PAGE.read_text()
    assert results_page.render_page(page, results_page.load()) == page, \
        "bench/README.md's tables differ from bench/results/current.json: run python bench/results_page.py render"


def test_every_committed_record_has_a_command_and_a_date_and_each_peer_row_is_listed_once():
    records = results_page.load()
    assert all(r.command and r.date and r.commit for r in records)
    cells = [(r.key, peer) for r in records for peer in (r.peers or {"": 0.0})]
    assert len(cells) == len(set(cells))
