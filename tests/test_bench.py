"""`tailrace bench serve`: statistics on hand-made records, SSE parsing of recorded streams, the load
generator against a fake transport, and one real run against a tailrace server on loopback."""

from __future__ import annotations

import asyncio
import json
import math
import sys
from pathlib import Path

import httpx
import pytest

from tailrace.bench.records import LevelResult, RequestRecord, StreamRecorder
from tailrace.bench.report import format_comparison, percentile, summarize, tpot, write_json
from tailrace.bench.levels import shard_sizes
from tailrace.bench.serve import LoadConfig, Workload, api_roots, request_body, run_level, send
from tailrace.bench.servers import ServerProcess, free_port, wait_ready
from tailrace.bench.sse import SSEDecoder, decode_lines
from tailrace.cli import main

# A completions stream as tailrace writes it: content chunks, the finish chunk, usage, [DONE].
RECORDED_STREAM = [
    'data: {"choices":[{"index":0,"text":"Hello"}]}', "",
    'data: {"choices":[{"index":0,"text":" wor"}]}', "",
    'data: {"choices":[{"index":0,"text":"ld!"}]}', "",
    'data: {"choices":[{"index":0,"text":"","finish_reason":"length"}]}', "",
    'data: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":4,"total_tokens":11}}', "",
    "data: [DONE]", "",
]


def record(ttft: float, itl: list[float], tokens: int, ok: bool = True, prompt_tokens: int = 10) -> RequestRecord:
    return RequestRecord(index=0, prompt_tokens=prompt_tokens, ok=ok, error="" if ok else "boom", ttft=ttft,
                         itl=itl, e2e=ttft + sum(itl), output_tokens=tokens, content_chunks=len(itl) + 1)


def replay(events: list[str], times: list[float], started: float = 0.0) -> RequestRecord:
    recorder = StreamRecorder(RequestRecord(index=0, prompt_tokens=99), started)
    for data, now in zip(events, times):
        recorder.on_event(data, now)
    return recorder.finish(times[-1])


# --- statistics ---

def test_percentile_interpolates_linearly_between_ranks():
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0], 99) == pytest.approx(3.97)
    assert percentile([5.0], 99) == 5.0


def test_percentile_of_no_samples_is_zero():
    assert percentile([], 50) == 0.0


def test_tpot_spreads_the_time_after_the_first_token_over_the_other_tokens():
    assert tpot(record(ttft=0.1, itl=[0.3, 0.6], tokens=10)) == pytest.approx(0.9 / 9)


def test_tpot_is_undefined_for_a_one_token_answer():
    assert tpot(record(ttft=0.1, itl=[], tokens=1)) is None


def test_summary_counts_only_successful_requests_in_latencies_and_throughput():
    records = [record(0.1, [0.01, 0.03], 3), record(0.3, [0.02, 0.02], 3), record(5.0, [9.0], 2, ok=False)]
    s = summarize(LevelResult(concurrency=2, request_rate=math.inf, duration=2.0, records=records))
    assert (s.completed, s.failed, s.first_error) == (2, 1, "boom")
    assert s.request_throughput == 1.0 and s.output_throughput == 3.0
    assert s.total_token_throughput == (20 + 6) / 2.0
    assert s.ttft_ms.mean == pytest.approx(200.0) and s.ttft_ms.p50 == pytest.approx(200.0)
    assert s.itl_ms.p50 == pytest.approx(20.0)  # the pooled gaps 10, 20, 20, 30
    assert s.tpot_ms.mean == pytest.approx(20.0)
    assert s.e2el_ms.p99 == pytest.approx(338.0)


def test_comparison_table_shows_ratios_on_headline_rows():
    ours = summarize(LevelResult(8, math.inf, 1.0, [record(0.1, [0.01] * 9, 10)]))
    peer = summarize(LevelResult(8, math.inf, 2.0, [record(0.2, [0.02] * 9, 10)]))
    table = format_comparison({"tailrace": ours, "peer": peer}, "tailrace")
    assert "concurrency 8" in table
    throughput_row = next(line for line in table.splitlines() if line.startswith("output tok/s"))
    assert throughput_row.split()[-1] == "2.00"
    ttft_row = next(line for line in table.splitlines() if line.startswith("TTFT p50"))
    assert ttft_row.split()[-1] == "0.50"


# --- SSE parsing and stream records ---

def test_sse_decoder_yields_each_events_data_at_the_blank_line():
    assert decode_lines(RECORDED_STREAM)[-1] == "[DONE]"
    assert len(decode_lines(RECORDED_STREAM)) == 6


def test_sse_decoder_joins_data_lines_and_skips_comments_and_other_fields():
    decoder = SSEDecoder()
    fed = [decoder.feed(line) for line in [": ping", "event: message", "data:a", "data: b", ""]]
    assert fed == [None, None, None, None, "a\nb"]


def test_sse_event_without_a_final_blank_line_is_flushed():
    assert decode_lines(['data: {"x":1}']) == ['{"x":1}']


def test_recorded_stream_gives_ttft_itl_per_content_chunk_and_usage_tokens():
    events = decode_lines(RECORDED_STREAM)
    r = replay(events, [0.5, 0.6, 0.8, 0.81, 0.82, 0.83])
    assert r.ok and r.error == ""
    assert r.ttft == pytest.approx(0.5)
    assert r.itl == pytest.approx([0.1, 0.2])  # the finish and usage chunks carry no content
    assert (r.output_tokens, r.content_chunks, r.prompt_tokens) == (4, 3, 7)
    assert r.e2e == pytest.approx(0.83)


def test_chunk_with_several_tokens_adds_one_gap_as_vllm_does():
    # " wor" + "ld!" arrive as one chunk: 2 content chunks, 1 gap, but usage counts 3 tokens.
    events = ['{"choices":[{"text":"Hello"}]}', '{"choices":[{"text":" world!"}]}',
              '{"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":3}}']
    r = replay(events, [1.0, 1.4, 1.4])
    assert r.itl == pytest.approx([0.4]) and r.output_tokens == 3
    assert tpot(r) == pytest.approx(0.4 / 2)


def test_without_usage_output_tokens_are_the_content_chunks():
    r = replay(['{"choices":[{"text":"a"}]}', '{"choices":[{"text":"b"}]}', "[DONE]"], [0.1, 0.2, 0.2])
    assert r.output_tokens == 2 and r.prompt_tokens == 99


def test_chat_deltas_count_content_but_not_the_role_chunk():
    events = ['{"choices":[{"delta":{"role":"assistant","content":""}}]}',
              '{"choices":[{"delta":{"content":"Hi"}}]}', '{"choices":[{"delta":{"content":"!"}}]}']
    r = replay(events, [0.1, 0.3, 0.4])
    assert r.ttft == pytest.approx(0.3) and r.content_chunks == 2


def test_in_band_error_event_fails_the_request():
    events = ['{"choices":[{"text":"a"}]}', '{"error":{"message":"engine died","type":"server_error"}}', "[DONE]"]
    r = replay(events, [0.1, 0.2, 0.2])
    assert not r.ok and r.error == "engine died"


def test_bare_string_error_event_fails_the_request():
    r = replay(['{"error": "CUDA out of memory"}'], [0.1])
    assert not r.ok and r.error == "CUDA out of memory"


def test_stream_without_content_fails_the_request():
    r = replay(['{"choices":[],"usage":{"completion_tokens":0}}', "[DONE]"], [0.1, 0.1])
    assert not r.ok and "without content" in r.error


# --- request bodies and the load generator on a fake transport ---

def test_request_body_asks_for_exact_length_and_usage_in_the_stream():
    body = request_body(LoadConfig(output_len=16, extra_body={"top_p": 0.5}), "m", "hi")
    assert body["prompt"] == "hi" and body["max_tokens"] == 16 and body["top_p"] == 0.5
    assert body["ignore_eos"] is True and body["min_tokens"] == 16
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}


def test_chat_body_sends_messages_and_no_exact_length_fields_when_turned_off():
    body = request_body(LoadConfig(endpoint="chat", exact_length=False), "m", "hi")
    assert body["messages"] == [{"role": "user", "content": "hi"}] and "prompt" not in body
    assert "ignore_eos" not in body and "min_tokens" not in body


def test_base_url_works_with_or_without_v1():
    assert api_roots("http://h:1/v1/") == ("http://h:1", "http://h:1/v1")
    assert api_roots("http://h:1") == ("http://h:1", "http://h:1/v1")


def run_fake_level(concurrency: int, request_rate: float) -> tuple[LevelResult, int]:
    in_flight = peak = 0
    body = ("\n".join(RECORDED_STREAM) + "\n").encode()

    async def handler(request: httpx.Request) -> httpx.Response:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.01)
        in_flight -= 1
        return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})

    async def run() -> LevelResult:
        config = LoadConfig(base_url="http://fake", request_rate=request_rate, progress=False)
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await run_level(client, config, "m", Workload(["a b"] * 12, 1.0, False), concurrency)

    return asyncio.run(run()), peak


def test_a_connection_closed_before_any_answer_is_tried_once_more_and_then_fails():
    body = ("\n".join(RECORDED_STREAM) + "\n").encode()
    calls = []

    def closing(times: int):
        async def handler(request: httpx.Request) -> httpx.Response:
            calls.append(request)
            if len(calls) <= times:
                raise httpx.RemoteProtocolError("Server disconnected without sending a response.", request=request)
            return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})
        return handler

    async def one(times: int) -> RequestRecord:
        calls.clear()
        async with httpx.AsyncClient(transport=httpx.MockTransport(closing(times))) as client:
            return await send(client, "http://fake/v1/completions", {"prompt": "a"}, RequestRecord(0, 3))

    retried = asyncio.run(one(1))
    assert retried.ok and retried.output_tokens == 4 and len(calls) == 2
    failed = asyncio.run(one(2))
    assert not failed.ok and "RemoteProtocolError" in failed.error and len(calls) == 2


def test_run_level_keeps_at_most_concurrency_requests_in_flight():
    level, peak = run_fake_level(concurrency=3, request_rate=math.inf)
    assert peak == 3
    assert all(r.ok and r.output_tokens == 4 for r in level.records)
    assert [r.index for r in level.records] == list(range(12))


def test_poisson_arrivals_spread_the_sends_out():
    level, _ = run_fake_level(concurrency=12, request_rate=200.0)
    sent = [r.sent for r in level.records]
    assert sent == sorted(sent) and sent[-1] > 0.01


# --- one real run against tailrace on loopback ---

@pytest.fixture(scope="module")
def tailrace_url(tiny_checkpoint: str, tmp_path_factory: pytest.TempPathFactory):
    port = free_port()
    command = [sys.executable, "-m", "tailrace", "serve", tiny_checkpoint, "--host", "127.0.0.1", "--port", str(port),
               "--served-model-name", "tiny", "--threads", "1", "--num-kv-blocks", "128", "--max-num-seqs", "8"]
    log = tmp_path_factory.mktemp("bench-server") / "server.log"
    with ServerProcess("tailrace", command, f"http://127.0.0.1:{port}", log) as server:
        wait_ready([server], timeout_s=90)
        memory = server.memory()
        status = (Path("/proc") / str(server.process.pid) / "status").read_text()
        own = int(next(line for line in status.splitlines() if line.startswith("VmRSS")).split()[1]) * 1024
        assert own < memory.rss <= memory.peak_rss  # the engine core's process counted beside the API's
        # shared pages split among the processes: at most what each holds resident, and all of it
        # anonymous or file-backed (no shared memory here)
        assert 0 < memory.pss <= memory.rss and memory.pss_anon + memory.pss_file <= memory.pss
        yield server.url


def test_bench_serve_writes_summaries_records_and_a_plot(tailrace_url: str, tmp_path: Path):
    out, png = tmp_path / "results.json", tmp_path / "results.png"
    rc = main(["bench", "serve", "--base-url", tailrace_url, "--num-prompts", "8", "--concurrency", "1,4",
               "--input-len", "32", "--output-len", "8", "--out", str(out), "--plot", str(png), "--no-progress"])
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["calibrated"] is True and result["config"]["model"] == "tiny"
    levels = result["runs"]["tiny"]
    assert [level["summary"]["concurrency"] for level in levels] == [1, 4]
    for level in levels:
        summary = level["summary"]
        assert summary["completed"] == 8 and summary["failed"] == 0
        assert summary["total_output_tokens"] == 8 * 8  # ignore_eos + min_tokens: exactly --output-len
        assert summary["output_throughput"] > 0 and summary["request_rate"] == "inf"
        for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
            assert set(summary[name]) == {"mean", "p50", "p99"} and summary[name]["p50"] > 0
        assert len(level["requests"]) == 8
        assert all(r["ok"] and r["output_tokens"] == 8 and len(r["itl"]) >= 1 for r in level["requests"])
    assert png.stat().st_size > 10_000


def test_bench_serve_over_two_client_processes_merges_their_records(tailrace_url: str, tmp_path: Path):
    out = tmp_path / "results.json"
    rc = main(["bench", "serve", "--base-url", tailrace_url, "--num-prompts", "7", "--concurrency", "3",
               "--input-len", "16", "--output-len", "5", "--processes", "2", "--out", str(out), "--no-progress"])
    assert rc == 0
    level = json.loads(out.read_text())["runs"]["tiny"][0]
    assert level["summary"]["completed"] == 7 and level["summary"]["total_output_tokens"] == 7 * 5
    assert [r["index"] for r in level["requests"]] == list(range(7))  # every prompt once, in order
    assert all(r["ok"] and r["output_tokens"] == 5 for r in level["requests"])
    assert level["summary"]["duration_s"] >= max(r["e2e"] for r in level["requests"])


def test_client_processes_split_the_concurrency_evenly():
    assert shard_sizes(256, 4) == [64] * 4
    assert shard_sizes(7, 3) == [3, 2, 2] and sum(shard_sizes(5, 5)) == 5


def test_json_output_goes_into_a_directory_made_for_it(tmp_path: Path):
    path = tmp_path / "bench" / "out" / "run.json"
    write_json(path, {"config": {}}, {})
    assert json.loads(path.read_text()) == {"config": {}, "runs": {}}
