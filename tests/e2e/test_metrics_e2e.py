"""vLLM's metric names on a real server: the counters and gauges dashboards read move under load."""

from __future__ import annotations

import threading

import httpx
from prometheus_client.parser import text_string_to_metric_families

from .conftest import MODEL

LONG = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True}


def vllm_values(http: httpx.Client) -> dict[tuple[str, str | None], float]:
    text = http.get("/metrics").text
    return {(s.name, s.labels.get("finished_reason")): s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name.startswith("vllm:") and s.labels.get("engine") == "0"
            and s.labels.get("model_name") == MODEL}


def test_vllm_counters_and_gauges_move_under_load(http: httpx.Client):
    before = vllm_values(http)
    requests = [threading.Thread(target=http.post, args=("/v1/completions",), kwargs={"json": LONG})
                for _ in range(4)]
    for thread in requests:
        thread.start()
    busy = [vllm_values(http) for _ in range(50) if any(t.is_alive() for t in requests)]
    for thread in requests:
        thread.join()
    after = vllm_values(http)
    assert max(v[("vllm:num_requests_running", None)] for v in busy) > 0
    assert max(v[("vllm:kv_cache_usage_perc", None)] for v in busy) > 0
    grew = {name: after[(name, reason)] - before[(name, reason)] for name, reason in [
        ("vllm:prompt_tokens_total", None), ("vllm:generation_tokens_total", None),
        ("vllm:request_success_total", "length"), ("vllm:prefix_cache_queries_total", None),
        ("vllm:time_to_first_token_seconds_count", None), ("vllm:inter_token_latency_seconds_count", None),
        ("vllm:e2e_request_latency_seconds_count", None), ("vllm:request_generation_tokens_sum", None)]}
    assert grew["vllm:generation_tokens_total"] == grew["vllm:request_generation_tokens_sum"] == 4 * LONG["max_tokens"]
    assert grew["vllm:request_success_total"] == 4 and grew["vllm:e2e_request_latency_seconds_count"] == 4
    assert all(value > 0 for value in grew.values()), grew
