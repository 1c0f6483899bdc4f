"""One PNG per benchmark: output throughput against concurrency, and TTFT and ITL distributions.

matplotlib is the optional `bench` extra, imported only here and only when a plot is asked for.
Colour tells the concurrency level, line style the server, so two servers share one figure.
"""

from __future__ import annotations

import math
from pathlib import Path

from tailrace.bench.records import LevelResult
from tailrace.bench.report import summarize

STYLES = (("-", "o"), ("--", "s"), (":", "^"), ("-.", "D"))


def cdf(values: list[float]) -> tuple[list[float], list[float]]:
    """Sorted values and the fraction of samples at or below each."""
    ordered = sorted(values)
    n = len(ordered)
    return ordered, [(i + 1) / n for i in range(n)]


def plot(runs: dict[str, list[LevelResult]], path: str | Path, title: str) -> None:
    """`runs` maps a server's label to its levels."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a server
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    fig, (throughput, ttft, itl) = plt.subplots(1, 3, figsize=(16, 4.8))
    colours = plt.get_cmap("viridis")
    levels = sorted({level.concurrency for run in runs.values() for level in run})
    colour_of = {c: colours(i / max(1, len(levels) - 1) * 0.9) for i, c in enumerate(levels)}
    for (label, run), (style, marker) in zip(runs.items(), STYLES * len(runs)):
        summaries = [summarize(level) for level in run]
        throughput.plot([s.concurrency for s in summaries], [s.output_throughput for s in summaries],
                        style, marker=marker, color="black", label=label)
        for level in run:
            done = [r for r in level.records if r.ok]
            name = f"{label} c={level.concurrency}"
            if done:
                ttft.plot(*cdf([r.ttft * 1000 for r in done]), style, color=colour_of[level.concurrency],
                          label=name, drawstyle="steps-post")
            gaps = [gap * 1000 for r in done for gap in r.itl]
            if gaps:
                itl.plot(*cdf(gaps), style, color=colour_of[level.concurrency], label=name, drawstyle="steps-post")
    throughput.set(xscale="log", xlabel="concurrency", ylabel="output tokens/s", title="Output throughput")
    throughput.set_xticks(levels, [str(c) for c in levels])
    throughput.xaxis.set_minor_formatter(NullFormatter())
    throughput.set_ylim(bottom=0)
    for axis, name in ((ttft, "Time to first token"), (itl, "Inter-token latency")):
        axis.set(xscale="log", xlabel="ms (log scale)", ylabel="fraction of samples", title=f"{name} (CDF)")
        # Plain numbers, as many steps per decade as the span leaves room for.
        low, high = axis.get_xlim()
        decades = math.log10(high / low)
        subs = (1.0,) if decades > 3 else (1.0, 2.0, 5.0) if decades > 1 else (1.0, 1.5, 2.0, 3.0, 5.0, 7.0)
        axis.xaxis.set_major_locator(LogLocator(subs=subs))
        axis.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
        axis.xaxis.set_minor_formatter(NullFormatter())
        axis.set_ylim(0, 1.01)
        axis.grid(alpha=0.3, which="both")
        axis.legend(fontsize=7)
    throughput.grid(alpha=0.3)
    throughput.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
