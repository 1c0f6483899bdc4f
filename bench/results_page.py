"""bench/README.md's tables of current figures, written from bench/results/current.json.

    python bench/results_page.py render            # rewrite the tables between the page's markers
    python bench/results_page.py render --check    # exit 1 if the page is not what render writes
    python bench/results_page.py add RECORD.json   # merge one record (or a list of them), then render

A record is one row: tailrace's figure and each peer's from the same run, for one machine,
precision, model shape and workload, concurrency and metric (the row's key), with the command that
measured them, its date and commit and a short note. The JSON is the only place a figure is
written by hand, so the page cannot drift from it: tests/test_results_page.py checks that the
committed page is what render writes. Everything outside the markers is prose, left as it is.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

BENCH = Path(__file__).resolve().parent
CURRENT = BENCH / "results" / "current.json"
PAGE = BENCH / "README.md"
BEGIN = "<!-- results:begin -->"
END = "<!-- results:end -->"
NOT_RECORDED = "not recorded"
GENERATED = ("<!-- Written by bench/results_page.py from bench/results/current.json: "
             "edit the JSON (or `add` a record), then render. -->")

Key = tuple[str, str, str, int, str]


@dataclass
class Record:
    machine: str  # CPU model and instruction sets (or the GPU): one table each
    precision: str  # tailrace's weights against the peers', e.g. "int4 vs Q4_0"
    shape: str  # the model shape and the workload (prompt / answer tokens), which set the figure
    concurrency: int
    metric: str  # e.g. "output tok/s"; ratios are tailrace / peer, so above 1 is tailrace ahead
    tailrace: float
    peers: dict[str, float] = field(default_factory=dict)  # each peer's figure from the same run
    command: str = ""
    date: str = ""
    commit: str = NOT_RECORDED
    note: str = ""

    @property
    def key(self) -> Key:
        return (self.machine, self.precision, self.shape, self.concurrency, self.metric)


def parse_records(data: object) -> list[Record]:
    """A record or a list of them, as JSON gives them; a missing or unknown field is an error."""
    items = data if isinstance(data, list) else [data]
    records = []
    for i, item in enumerate(items):
        try:
            records.append(Record(**item))
        except TypeError as exc:  # the dataclass names the missing or unexpected field
            raise ValueError(f"record {i}: {exc}") from exc
    return records


def load(path: Path = CURRENT) -> list[Record]:
    return parse_records(json.loads(Path(path).read_text()))


def save(records: list[Record], path: Path = CURRENT) -> None:
    Path(path).write_text(json.dumps([asdict(r) for r in records], indent=1, ensure_ascii=False) + "\n")


def merge(records: list[Record], new: Record) -> list[Record]:
    """`records` with `new` in: a remeasured row is overwritten, never appended twice.

    An older record with the same key loses the peers the new run measured again; one left with
    no peer goes, and the new record takes its place. A peer the new run did not measure keeps
    its older row, with the tailrace figure of its own run, since a ratio only means anything
    between figures of one run on one machine."""
    merged: list[Record] = []
    placed = False
    for old in records:
        if old.key != new.key:
            merged.append(old)
            continue
        rest = {name: value for name, value in old.peers.items() if name not in new.peers}
        if rest:
            merged.append(replace(old, peers=rest))
        elif not placed:
            merged.append(new)
            placed = True
    return merged if placed else merged + [new]


def number(value: float) -> str:
    """As the record gives it (no digits made up), with thousands separators."""
    return f"{value:,}"


def cell(text: str) -> str:
    return text.replace("|", "\\|")  # a bare pipe would end the table's cell


def machine_table(machine: str, rows: list[Record]) -> str:
    """One machine's rows, grouped by shape and precision in the order the JSON first names them,
    and its commands listed once below the table (rows of one run share one)."""
    shapes = list(dict.fromkeys(r.shape for r in rows))
    precisions = list(dict.fromkeys(r.precision for r in rows))
    rows = sorted(rows, key=lambda r: (shapes.index(r.shape), precisions.index(r.precision), r.concurrency, r.metric))
    peers = list(dict.fromkeys(name for r in rows for name in r.peers))
    commands = list(dict.fromkeys(r.command for r in rows))
    head = (["model shape, workload", "precision", "c", "metric", "tailrace"] + peers
            + [f"tailrace / {name}" for name in peers] + ["date", "commit", "command", "note"])
    align = ["---", "---", "---:", "---", "---:"] + ["---:"] * (2 * len(peers)) + ["---", "---", "---:", "---"]
    lines = [f"### {machine}", "", "| " + " | ".join(head) + " |", "| " + " | ".join(align) + " |"]
    for r in rows:
        values = [number(r.peers[name]) if name in r.peers else "-" for name in peers]
        ratios = [f"{r.tailrace / r.peers[name]:.2f}x" if r.peers.get(name) else "-" for name in peers]
        fields = ([r.shape, r.precision, str(r.concurrency), r.metric, number(r.tailrace)] + values + ratios
                  + [r.date, r.commit, str(commands.index(r.command) + 1), r.note])
        lines.append("| " + " | ".join(cell(f) for f in fields) + " |")
    lines += ["", "Commands:", ""] + [f"{i}. `{command}`" for i, command in enumerate(commands, 1)]
    return "\n".join(lines)


def render_tables(records: list[Record]) -> str:
    machines = list(dict.fromkeys(r.machine for r in records))  # the JSON's order
    tables = [machine_table(m, [r for r in records if r.machine == m]) for m in machines]
    return "\n\n".join([GENERATED] + tables)


def render_page(page: str, records: list[Record]) -> str:
    """`page` with its tables between the markers written anew; the rest of it unchanged."""
    start, end = page.find(BEGIN), page.find(END)
    if start < 0 or end < start:
        raise ValueError(f"the page has no {BEGIN} ... {END} section")
    return page[:start + len(BEGIN)] + "\n" + render_tables(records) + "\n" + page[end:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", nargs="?", choices=("render", "add"), default="render")
    parser.add_argument("record", nargs="?", help="for add: a JSON file of one record or a list of them")
    parser.add_argument("--check", action="store_true", help="render: exit 1 if the page is stale, write nothing")
    parser.add_argument("--results", type=Path, default=CURRENT, help="the records (default: %(default)s)")
    parser.add_argument("--page", type=Path, default=PAGE, help="the page (default: %(default)s)")
    args = parser.parse_args(argv)
    if (args.command == "add") != (args.record is not None):
        parser.error("add takes one RECORD.json; render takes none")
    if args.command == "add" and args.check:
        parser.error("--check only checks; it does not go with add")

    records = load(args.results)
    if args.command == "add":
        for new in parse_records(json.loads(Path(args.record).read_text())):
            records = merge(records, new)
        save(records, args.results)
    page = args.page.read_text()
    rendered = render_page(page, records)
    if args.check:
        if rendered != page:
            print(f"{args.page} is not what {args.results} renders: run python bench/results_page.py render",
                  file=sys.stderr)
            return 1
        return 0
    args.page.write_text(rendered)
    return 0


if __name__ == "__main__":
    sys.exit(main())
