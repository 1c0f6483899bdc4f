"""The figures `vllm bench serve` reports, computed from request records, and their text and JSON forms.

Latency statistics cover successful requests only; throughput divides by the level's whole
duration. A statistic over no samples is 0.0, as in vLLM, so the JSON stays plain numbers.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tailrace.bench.records import LevelResult, RequestRecord


@dataclass(slots=True)
class Stat:
    mean: float
    p50: float
    p99: float


@dataclass(slots=True)
class LevelSummary:
    concurrency: int
    request_rate: float
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float  # completed requests/s
    output_throughput: float  # output tokens/s
    total_token_throughput: float  # (input + output) tokens/s
    ttft_ms: Stat
    tpot_ms: Stat
    itl_ms: Stat
    e2el_ms: Stat
    first_error: str  # what the first failed request said; "" when none failed


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default, which vLLM uses)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def stat_ms(seconds: list[float]) -> Stat:
    ms = [s * 1000 for s in seconds]
    mean = sum(ms) / len(ms) if ms else 0.0
    return Stat(mean=mean, p50=percentile(ms, 50), p99=percentile(ms, 99))


def tpot(record: RequestRecord) -> float | None:
    """Time per output token after the first; undefined for a one-token answer."""
    if record.output_tokens < 2:
        return None
    return (record.e2e - record.ttft) / (record.output_tokens - 1)


def summarize(level: LevelResult) -> LevelSummary:
    done = [r for r in level.records if r.ok]
    failed = [r for r in level.records if not r.ok]
    input_tokens = sum(r.prompt_tokens for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    duration = level.duration if level.duration > 0 else math.inf
    return LevelSummary(
        concurrency=level.concurrency, request_rate=level.request_rate,
        completed=len(done), failed=len(failed), duration_s=level.duration,
        total_input_tokens=input_tokens, total_output_tokens=output_tokens,
        request_throughput=len(done) / duration, output_throughput=output_tokens / duration,
        total_token_throughput=(input_tokens + output_tokens) / duration,
        ttft_ms=stat_ms([r.ttft for r in done]),
        tpot_ms=stat_ms([t for r in done if (t := tpot(r)) is not None]),
        itl_ms=stat_ms([gap for r in done for gap in r.itl]),
        e2el_ms=stat_ms([r.e2e for r in done]),
        first_error=failed[0].error if failed else "",
    )


def format_summary(title: str, s: LevelSummary) -> str:
    """A block laid out like `vllm bench serve`'s result, so the numbers read the same way."""
    rate = "inf" if math.isinf(s.request_rate) else f"{s.request_rate:g}"
    rows = [
        ("Maximum request concurrency:", f"{s.concurrency}"),
        ("Request rate (req/s):", rate),
        ("Successful requests:", f"{s.completed}"),
        ("Failed requests:", f"{s.failed}"),
        ("Benchmark duration (s):", f"{s.duration_s:.2f}"),
        ("Total input tokens:", f"{s.total_input_tokens}"),
        ("Total generated tokens:", f"{s.total_output_tokens}"),
        ("Request throughput (req/s):", f"{s.request_throughput:.2f}"),
        ("Output token throughput (tok/s):", f"{s.output_throughput:.2f}"),
        ("Total token throughput (tok/s):", f"{s.total_token_throughput:.2f}"),
    ]
    lines = [f"{' ' + title + ' ':=^52}"] + [f"{k:<40}{v:>12}" for k, v in rows]
    for name, label, stat in (("TTFT", "Time to First Token", s.ttft_ms),
                              ("TPOT", "Time per Output Token (excl. 1st token)", s.tpot_ms),
                              ("ITL", "Inter-token Latency", s.itl_ms),
                              ("E2EL", "End-to-end Latency", s.e2el_ms)):
        lines.append(f"{label:-^52}")
        lines += [f"{f'{kind} {name} (ms):':<40}{value:>12.2f}"
                  for kind, value in (("Mean", stat.mean), ("Median", stat.p50), ("P99", stat.p99))]
    if s.first_error:
        lines.append(f"First error: {s.first_error[:300]}")
    lines.append("=" * 52)
    return "\n".join(lines)


def level_json(level: LevelResult) -> dict[str, Any]:
    return {"summary": asdict(summarize(level)), "requests": [asdict(r) for r in level.records]}


def write_json(path: str | Path, meta: dict[str, Any], runs: dict[str, list[LevelResult]]) -> None:
    """`runs` maps a server's label to its levels; `meta` is the run's settings."""
    body = {**meta, "runs": {label: [level_json(level) for level in levels] for label, levels in runs.items()}}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(_json_safe(body), indent=1) + "\n")


def _json_safe(obj: Any) -> Any:
    """JSON has no infinity: an unbounded request rate is written as the string "inf"."""
    if isinstance(obj, float) and math.isinf(obj):
        return "inf"
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_json_safe(v) for v in obj]
    return obj


HEADLINE = ("output tok/s", "TTFT p50 (ms)", "TPOT p50 (ms)", "ITL p50 (ms)")


def comparison_rows(s: LevelSummary) -> list[tuple[str, float | int]]:
    return [
        ("successful requests", s.completed),
        ("failed requests", s.failed),
        ("duration (s)", s.duration_s),
        ("request throughput (req/s)", s.request_throughput),
        ("output tok/s", s.output_throughput),
        ("total tok/s", s.total_token_throughput),
        ("TTFT p50 (ms)", s.ttft_ms.p50),
        ("TTFT p99 (ms)", s.ttft_ms.p99),
        ("TPOT p50 (ms)", s.tpot_ms.p50),
        ("TPOT p99 (ms)", s.tpot_ms.p99),
        ("ITL p50 (ms)", s.itl_ms.p50),
        ("ITL p99 (ms)", s.itl_ms.p99),
    ]


def format_comparison(summaries: dict[str, LevelSummary], ours: str) -> str:
    """Every server's figures for one level side by side, with ours/peer ratios on the headline rows
    (above 1 is better for throughput, below 1 for latencies)."""
    peers = [name for name in summaries if name != ours]
    rows = {name: comparison_rows(s) for name, s in summaries.items()}
    ratio_names = [f"{ours}/{peer}" for peer in peers]
    width = max(14, *(len(n) + 2 for n in [*summaries, *ratio_names]))
    lines = [f"--- concurrency {summaries[ours].concurrency} ---",
             f"{'':<28}" + "".join(f"{n:>{width}}" for n in [*summaries, *ratio_names])]
    for i, (label, _) in enumerate(rows[ours]):
        values = [rows[name][i][1] for name in summaries]
        cells = [f"{v:>{width}d}" if isinstance(v, int) else f"{v:>{width}.2f}" for v in values]
        ratios = [_ratio(rows[ours][i][1], rows[peer][i][1]) if label in HEADLINE else "" for peer in peers]
        lines.append(f"{label:<28}" + "".join(cells) + "".join(f"{r:>{width}}" for r in ratios))
    for name, s in summaries.items():
        if s.first_error:
            lines.append(f"{name} first error: {s.first_error[:300]}")
    return "\n".join(lines)


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b else ""


def format_level_line(name: str, s: LevelSummary) -> str:
    """One level's headline figures on one line, as a server finishes it."""
    return (f"{name} concurrency {s.concurrency}: {s.output_throughput:.2f} output tok/s, "
            f"TTFT p50 {s.ttft_ms.p50:.1f} ms, TPOT p50 {s.tpot_ms.p50:.1f} ms, "
            f"{s.completed} ok, {s.failed} failed")
