"""Prometheus metrics: names, values, and per-instance registries."""

from prometheus_client.parser import text_string_to_metric_families

from tailrace.engine.stats import EngineStats
from tailrace.metrics import ServerMetrics


def samples(metrics: ServerMetrics, stats: EngineStats | None = None) -> dict:
    text = metrics.render(stats or EngineStats()).decode()
    return {(s.name, s.labels.get("finished_reason")): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_token_counters_add_up():
    metrics = ServerMetrics("tiny")
    metrics.add_tokens(prompt=5, generation=7)
    metrics.add_tokens(prompt=1, generation=2)
    got = samples(metrics)
    assert (got[("tailrace:prompt_tokens_total", None)], got[("tailrace:generation_tokens_total", None)]) == (6, 9)


def test_finishes_are_counted_by_reason():
    metrics = ServerMetrics()
    for reason in ("stop", "stop", "length"):
        metrics.count_finish(reason, prompt_tokens=3, generation_tokens=4)
    got = samples(metrics)
    assert (got[("tailrace:request_success_total", "stop")],
            got[("tailrace:request_success_total", "length")]) == (2, 1)


def test_latency_histograms_count_observations():
    metrics = ServerMetrics()
    metrics.observe_ttft(0.05)
    metrics.observe_itl(0.01)
    metrics.observe_itl(0.02)
    metrics.observe_e2e(1.5)
    got = samples(metrics)
    assert (got[("tailrace:time_to_first_token_seconds_count", None)],
            got[("tailrace:inter_token_latency_seconds_count", None)],
            got[("tailrace:e2e_request_latency_seconds_sum", None)]) == (1, 2, 1.5)


def test_engine_stats_are_read_at_render_time():
    metrics = ServerMetrics()
    stats = EngineStats(num_running=3, num_waiting=2, num_total_blocks=100, num_free_blocks=40,
                        kv_usage=0.6, prefix_cache_queries=50, prefix_cache_hits=20, num_preemptions=1)
    got = samples(metrics, stats)
    assert {name: got[(name, None)] for name in (
        "tailrace:num_requests_running", "tailrace:num_requests_waiting", "tailrace:kv_cache_usage_perc",
        "tailrace:num_free_kv_blocks", "tailrace:num_total_kv_blocks", "tailrace:prefix_cache_queries_total",
        "tailrace:prefix_cache_hits_total", "tailrace:num_preemptions_total")} == {
        "tailrace:num_requests_running": 3, "tailrace:num_requests_waiting": 2,
        "tailrace:kv_cache_usage_perc": 0.6, "tailrace:num_free_kv_blocks": 40,
        "tailrace:num_total_kv_blocks": 100, "tailrace:prefix_cache_queries_total": 50,
        "tailrace:prefix_cache_hits_total": 20, "tailrace:num_preemptions_total": 1}


def test_later_render_shows_the_new_stats():
    metrics = ServerMetrics()
    metrics.render(EngineStats(num_running=5))
    assert samples(metrics, EngineStats(num_running=1))[("tailrace:num_requests_running", None)] == 1


def test_two_instances_do_not_share_state():
    first, second = ServerMetrics(), ServerMetrics()
    first.add_tokens(prompt=10, generation=0)
    assert samples(second)[("tailrace:prompt_tokens_total", None)] == 0


def test_samples_carry_the_model_name_label():
    text = ServerMetrics("tiny").render(EngineStats()).decode()
    assert 'tailrace:num_requests_running{model_name="tiny"}' in text


def vllm_samples(text: str) -> dict:
    return {(s.name, s.labels.get("finished_reason")): s for family in text_string_to_metric_families(text)
            for s in family.samples if s.name.startswith("vllm:")}


def test_vllm_names_carry_model_name_and_engine_labels():
    text = ServerMetrics("tiny").render(EngineStats(num_running=2)).decode()
    assert 'vllm:num_requests_running{engine="0",model_name="tiny"} 2.0' in text


def test_every_vllm_series_reads_the_same_as_its_tailrace_twin():
    metrics = ServerMetrics("tiny")
    metrics.add_tokens(prompt=4, generation=9)
    metrics.count_finish("length", prompt_tokens=4, generation_tokens=9)
    metrics.observe_itl(0.02)
    text = metrics.render(EngineStats(num_waiting=3, kv_usage=0.25, prefix_cache_queries=8,
                                      prefix_cache_hits=5, num_preemptions=2)).decode()
    ours = {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}
    twins = {(name.replace("vllm:", "tailrace:"), tuple((k, v) for k, v in labels if k != "engine")): value
             for (name, labels), value in ours.items() if name.startswith("vllm:")}
    assert twins == {key: ours[key] for key in twins}


def test_the_vllm_dashboard_series_are_all_there():
    names = {name for name, _ in vllm_samples(ServerMetrics().render(EngineStats()).decode())}
    assert names >= {
        "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
        "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total",
        "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
        "vllm:request_prompt_tokens_bucket", "vllm:request_generation_tokens_bucket",
        "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
        "vllm:e2e_request_latency_seconds_bucket"}


def test_no_created_series_are_written():
    metrics = ServerMetrics()
    metrics.add_tokens(prompt=1, generation=1)
    metrics.observe_e2e(1.0)
    assert "_created" not in metrics.render(EngineStats()).decode()


def test_request_success_reads_zero_for_a_reason_not_seen_yet():
    got = vllm_samples(ServerMetrics().render(EngineStats()).decode())
    assert [got[("vllm:request_success_total", r)].value for r in ("stop", "length", "abort")] == [0, 0, 0]


def test_a_value_on_a_bucket_bound_counts_in_that_bucket():
    metrics = ServerMetrics()
    metrics.observe_ttft(0.1)
    families = text_string_to_metric_families(metrics.render(EngineStats()).decode())
    buckets = {s.labels["le"]: s.value for family in families for s in family.samples
               if s.name == "vllm:time_to_first_token_seconds_bucket"}
    assert (buckets["0.08"], buckets["0.1"], buckets["+Inf"]) == (0, 1, 1)


def test_each_finish_records_its_prompt_and_generation_sizes():
    metrics = ServerMetrics()
    metrics.count_finish("stop", prompt_tokens=30, generation_tokens=7)
    got = vllm_samples(metrics.render(EngineStats()).decode())
    assert (got[("vllm:request_prompt_tokens_sum", None)].value,
            got[("vllm:request_generation_tokens_sum", None)].value) == (30, 7)
