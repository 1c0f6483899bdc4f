"""Load runs through the very scripts that produce the reliability figures (bench/): the disconnect
storm at full size, a short soak in CI, and the 10-minute soak when asked for (-m slow)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import disconnect_storm
import soak
from harness import API_KEY, ServerProcess

from .conftest import start_server


@pytest.fixture(scope="module")
def default_server(tmp_path_factory: pytest.TempPathFactory):
    """A server with the default flags, as `tailrace serve` starts."""
    with start_server(tmp_path_factory, "load-server") as server:
        yield server


def run_script(script, args: list[str], json_path: Path) -> dict:
    script.main([*args, "--json", str(json_path)])
    return json.loads(json_path.read_text())


def test_disconnect_storm_of_200_streams_leaves_no_error_and_an_idle_engine(default_server: ServerProcess,
                                                                             tmp_path: Path):
    figures = run_script(disconnect_storm, ["--url", default_server.url, "--api-key", API_KEY, "--streams", "200"],
                         tmp_path / "storm.json")
    assert figures["errors"] == []
    assert figures["disconnected"] > 50 and figures["hang_ups"].get("mid-stream", 0) > 10
    assert figures["completed"] == figures["streams"] - figures["disconnected"]
    assert figures["idle_after_s"] is not None and figures["idle_after_s"] <= 2.0


def test_short_soak_has_no_failed_request(default_server: ServerProcess, tmp_path: Path):
    figures = run_script(soak, ["--url", default_server.url, "--api-key", API_KEY, "--duration", "20",
                                "--concurrency", "32", "--window", "10"], tmp_path / "soak.json")
    assert figures["failed"] == 0, figures["failures"]
    assert figures["requests"] > 32


@pytest.mark.slow
def test_ten_minute_soak_at_64_passes(tmp_path: Path):
    figures = run_script(soak, ["--duration", "600", "--concurrency", "64"], tmp_path / "soak.json")
    assert figures["failed"] == 0, figures["failures"]
    assert figures["rss_growth"] < soak.MAX_RSS_GROWTH
    assert figures["p99_last_over_second"] <= soak.MAX_P99_RATIO
