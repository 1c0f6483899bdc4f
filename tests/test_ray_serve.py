"""tailrace under Ray Serve (tailrace.ray): two engine replicas behind the OpenAI routes, and prefix-aware
routing against Ray's default router on a workload of shared system prompts.

Marked `ray`: they need .venv-ray (`bin/setup ray`), and `.ci/run` runs them after bin/test with
`-m ray`. The same Ray app also answers the e2e SDK tests and stream-vs-non-stream matrix there
(TAILRACE_E2E_SERVER=ray). Ray is imported inside the fixtures, so that collecting this file in the
lean .venv works (its tests are deselected there).
"""

from __future__ import annotations

import asyncio
import random
import socket
from collections.abc import Iterator

import httpx
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tailrace.engine.stats import EngineStats

pytestmark = pytest.mark.ray

SYSTEM_PROMPTS = 8
REQUESTS_PER_PROMPT = 32
CONCURRENCY = 16
# Each replica's KV cache holds about five of the system prompts (about 12 blocks each) besides its
# running requests: enough for the four that prefix-aware routing sends it, too few for all eight.
NUM_KV_BLOCKS = 80
APPS = {"prefix": "prefix", "pow2": "pow2"}  # app name (and route) -> request_router


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def serve_url() -> Iterator[str]:
    """A Ray instance in this process with two apps of two replicas each (one thread, one CPU), one
    per router, at /prefix and /pow2."""
    import ray
    from ray import serve

    from tailrace.ray import build

    # Four replicas of one CPU each on two cores, and one for the drain test: Ray's CPU count is a
    # reservation, not a measurement.
    ray.init(num_cpus=2 * len(APPS) + 1, include_dashboard=False, object_store_memory=256 * 1024**2,
             log_to_driver=False)
    port = _free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run_many([serve.RunTarget(build({"num_replicas": 2, "threads": 1, "served-model-name": "tiny",
                                               "num-kv-blocks": NUM_KV_BLOCKS, "request_router": router}),
                                        name=name, route_prefix=f"/{name}")
                        for name, router in APPS.items()])
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def _workload() -> list[str]:
    """8 system prompts x 32 questions, interleaved at random (seeded)."""
    systems = [f"System prompt {i}: you are assistant number {i}. " + " ".join(
        f"Rule {i}.{k}: answer about module {k * 7 + i} of the standard library in plain words." for k in range(8))
        for i in range(SYSTEM_PROMPTS)]
    prompts = [f"{system}\nQuestion {j}: what does function {j} return?\nAnswer:"
               for system in systems for j in range(REQUESTS_PER_PROMPT)]
    random.Random(0).shuffle(prompts)
    return prompts


async def _run(base: str, prompts: list[str]) -> None:
    gate = asyncio.Semaphore(CONCURRENCY)
    async with httpx.AsyncClient(base_url=base, timeout=120) as client:
        async def one(prompt: str) -> None:
            async with gate:
                response = await client.post("/v1/completions", json={"model": "tiny", "prompt": prompt,
                                                                       "max_tokens": 2, "temperature": 0})
                response.raise_for_status()

        await asyncio.gather(*(one(p) for p in prompts))


def _prefix_hit_rate(metrics: str) -> float:
    values = {sample.name: sample.value for family in text_string_to_metric_families(metrics)
              for sample in family.samples}
    return values["vllm:prefix_cache_hits_total"] / values["vllm:prefix_cache_queries_total"]


@pytest.fixture(scope="module")
def hit_rates(serve_url: str) -> dict[str, float]:
    """Each app's prefix-cache hit rate over the workload, from its /metrics (the replicas' counters)."""
    rates = {}
    for name in APPS:
        asyncio.run(_run(f"{serve_url}/{name}", _workload()))
        rates[name] = _prefix_hit_rate(httpx.get(f"{serve_url}/{name}/metrics").text)
    print(f"prefix-cache hit rate: {rates}")
    return rates


def test_prefix_aware_routing_hits_the_prefix_cache_clearly_more_than_the_default(hit_rates: dict[str, float]) -> None:
    # The ceiling is 0.85: each system prompt's first request misses, and the questions are never cached.
    assert hit_rates["prefix"] > 0.75
    assert hit_rates["prefix"] > hit_rates["pow2"] + 0.15


def test_a_stream_through_ray_comes_in_pieces_that_join_to_the_whole_answer(serve_url: str) -> None:
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 8, "temperature": 0}
    whole = httpx.post(f"{serve_url}/prefix/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    with httpx.stream("POST", f"{serve_url}/prefix/v1/completions", json={**body, "stream": True},
                      timeout=60) as response:
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and len(events) > 3
    assert "".join(orjson.loads(e)["choices"][0]["text"] for e in events[:-1]) == whole


def test_a_bad_request_gets_the_apis_own_error_through_ray(serve_url: str) -> None:
    response = httpx.post(f"{serve_url}/prefix/v1/completions", json={"model": "tiny", "prompt": "x",
                                                                       "max_tokens": -1}, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"


def test_a_replica_that_ray_drains_finishes_its_open_stream(serve_url: str) -> None:
    """Ray drains the replicas of an app it deletes (as it does a replica it scales down): the stream
    one of them is serving ends complete, its engine core untouched until the replica is done."""
    from ray import serve

    from tailrace.ray import build

    serve.run(build({"num_replicas": 1, "threads": 1, "served-model-name": "tiny"}), name="drain",
              route_prefix="/drain")
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 300, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{serve_url}/drain/v1/completions", json=body, timeout=120) as response:
        lines = (line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: "))
        events = [next(lines)]
        serve.delete("drain", _blocking=False)
        events += list(lines)
    assert events[-1] == "[DONE]"
    chunks = [orjson.loads(e) for e in events[:-1]]
    assert not any("error" in c for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 300


def test_replicas_stats_add_up_with_kv_usage_over_all_blocks() -> None:
    from tailrace.ray.remote_engine import combined_stats

    total = combined_stats([EngineStats(num_running=2, num_total_blocks=100, num_free_blocks=50,
                                        prefix_cache_queries=10, prefix_cache_hits=5),
                            EngineStats(num_running=1, num_total_blocks=100, num_free_blocks=100,
                                        prefix_cache_queries=30, prefix_cache_hits=15)])
    assert (total.num_running, total.prefix_cache_queries, total.prefix_cache_hits) == (3, 40, 20)
    assert total.kv_usage == pytest.approx(0.25)


def test_serve_flags_and_ray_options_are_told_apart() -> None:
    from tailrace.ray.deployment import split_args

    options, argv = split_args({"num_replicas": "3", "max-num-seqs": 8, "enforce-eager": "true",
                                "served-model-name": ["a", "b"], "request_router": "pow2"})
    assert (options.num_replicas, options.request_router) == (3, "pow2")
    assert argv == ["--max-num-seqs", "8", "--enforce-eager", "--served-model-name", "a", "b"]


def test_an_unknown_router_or_flag_is_named() -> None:
    from tailrace.ray.deployment import parse_serve_args, split_args

    with pytest.raises(ValueError, match="request_router=fastest"):
        split_args({"request_router": "fastest"})
    with pytest.raises(ValueError, match="--no-such-flag"):
        parse_serve_args(["--no-such-flag", "1"])


def test_autoscaling_passes_through_and_each_replica_reserves_one_bundle_of_its_cpus() -> None:
    from tailrace.cli import engine_config_from
    from tailrace.ray.deployment import engine_deployment, parse_serve_args, split_args

    options, argv = split_args({"threads": 2, "autoscaling_config": '{"min_replicas": 1, "max_replicas": 4}'})
    args = parse_serve_args(argv)
    deployment = engine_deployment(engine_config_from(args), args, options)
    assert deployment._deployment_config.autoscaling_config.max_replicas == 4  # no public getter
    assert deployment._replica_config.placement_group_bundles == [{"CPU": 2.0}]
    assert deployment._replica_config.placement_group_strategy == "STRICT_PACK"
    assert options.most_replicas == 4
