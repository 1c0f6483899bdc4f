import asyncio
import os
import signal

import pytest

from tailrace.engine.client import EngineClient, EngineDeadError, RequestFailedError
from tailrace.engine.output_processor import OutputProcessor
from tailrace.engine.config import EngineConfig
from tailrace.engine.model_runner import ModelRunner
from tailrace.llm import LLM
from tailrace.sampling_params import SamplingParams


def config(path: str, **kwargs: object) -> EngineConfig:
    return EngineConfig(model=path, threads=1, **kwargs)


async def collect(client: EngineClient, rid: str, ids: list[int], params: SamplingParams) -> list:
    return [delta async for delta in client.add_request(rid, ids, params)]


def test_deltas_join_to_the_offline_result(tiny_checkpoint):
    params = SamplingParams(n=2, max_tokens=12, temperature=1.0, seed=3, logprobs=1, ignore_eos=True)
    ids = [5, 6, 7, 8, 9]
    offline = LLM(tiny_checkpoint, threads=1).generate([ids], params)[0]

    async def main():
        client = await EngineClient.start(config(tiny_checkpoint, in_process=True))
        try:
            return await collect(client, "r", ids, params)
        finally:
            await client.shutdown()

    deltas = asyncio.run(main())
    assert deltas[-1].finished and not any(d.finished for d in deltas[:-1])
    for j in range(2):
        mine = [d.outputs[0] for d in deltas if d.outputs[0].index == j]
        assert "".join(o.text for o in mine) == offline.outputs[j].text
        assert [t for o in mine for t in o.token_ids] == offline.outputs[j].token_ids
        assert sum(len(o.logprobs) for o in mine) == len(offline.outputs[j].token_ids)
        assert [o.finish_reason for o in mine if o.finish_reason] == ["length"]


def test_core_process_serves_and_abort_frees_memory(tiny_checkpoint):
    async def main():
        client = await EngineClient.start(config(tiny_checkpoint))
        try:
            idle = client.stats().num_free_blocks
            stream = client.add_request("long", [5, 6, 7], SamplingParams(max_tokens=400, ignore_eos=True))
            await stream.__anext__()
            await stream.__anext__()
            await stream.aclose()
            for _ in range(100):
                await asyncio.sleep(0.01)
                if client.stats().num_running == 0 and client.stats().num_free_blocks == idle:
                    break
            return idle, client.stats()
        finally:
            await client.shutdown()

    idle, stats = asyncio.run(main())
    assert stats.num_running == 0 and stats.num_free_blocks == idle


def test_invalid_request_fails_only_itself(tiny_checkpoint):
    async def main():
        client = await EngineClient.start(config(tiny_checkpoint, in_process=True))
        try:
            with pytest.raises(ValueError):
                await collect(client, "bad", [10**7], SamplingParams())
            good = await collect(client, "good", [5, 6], SamplingParams(max_tokens=3, ignore_eos=True))
            return good
        finally:
            await client.shutdown()

    good = asyncio.run(main())
    assert good[-1].outputs[0].finish_reason == "length"


def test_core_crash_fails_open_requests_instead_of_hanging(tiny_checkpoint):
    async def main():
        client = await EngineClient.start(config(tiny_checkpoint))
        stream = client.add_request("r", [5, 6, 7], SamplingParams(max_tokens=400, ignore_eos=True))
        await stream.__anext__()
        os.kill(client._worker.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError):
            async with asyncio.timeout(10):
                async for _ in stream:
                    pass
        assert client.errored and not client.is_ready
        with pytest.raises(EngineDeadError):
            await collect(client, "after", [5], SamplingParams())
        await client.shutdown()

    asyncio.run(main())


def test_stop_string_finishes_one_choice_and_reports_it(tiny_checkpoint):
    llm = LLM(tiny_checkpoint, threads=1)
    greedy = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    text = llm.generate([[5, 6, 7]], greedy)[0].outputs[0].text
    stop = text[4:6]
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True,
                                                  stop=[stop]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[:text.index(stop)]
    assert llm.core.blocks.num_free_blocks == llm.core.blocks.num_blocks


def test_a_fault_processing_one_request_fails_only_that_request(tiny_checkpoint, monkeypatch):
    original = OutputProcessor._choice_delta

    def fail_for_marked(self, state, out, result):
        if state.request_id == "faulty":
            raise RuntimeError("injected")
        return original(self, state, out, result)

    monkeypatch.setattr(OutputProcessor, "_choice_delta", fail_for_marked)

    async def main():
        client = await EngineClient.start(config(tiny_checkpoint, in_process=True))
        try:
            params = SamplingParams(max_tokens=12, ignore_eos=True)
            good, bad = await asyncio.gather(collect(client, "good", [5, 6], params),
                                             collect(client, "faulty", [5, 6], params), return_exceptions=True)
            for _ in range(100):  # the core was told to drop the faulty request
                if client.stats().num_running == 0:
                    break
                await asyncio.sleep(0.01)
            return good, bad, client.is_ready, client.stats().num_running
        finally:
            await client.shutdown()

    good, bad, ready, running = asyncio.run(main())
    assert isinstance(bad, RequestFailedError)
    assert good[-1].outputs[0].finish_reason == "length" and sum(len(d.outputs[0].token_ids) for d in good) == 12
    assert ready and running == 0


def test_death_is_announced_to_waiters(tiny_checkpoint):
    async def main():
        client = await EngineClient.start(config(tiny_checkpoint))
        waiter = asyncio.create_task(client.wait_dead())
        await asyncio.sleep(0)
        assert not waiter.done()
        os.kill(client._worker.pid, signal.SIGKILL)
        async with asyncio.timeout(10):
            reason = await waiter
        await client.shutdown()
        return reason

    assert "exited" in asyncio.run(main())


def test_outputs_held_back_a_step_as_on_cuda_arrive_whole_and_aborts_still_free_memory(tiny_checkpoint, monkeypatch):
    # On CUDA the core sends a step's outputs while the device runs the next step.
    params = SamplingParams(max_tokens=16, temperature=0, logprobs=1, ignore_eos=True)
    prompts = {"a": [5, 6, 7, 8, 9], "b": [10, 11, 12]}
    offline = {rid: out.outputs[0] for rid, out in
               zip(prompts, LLM(tiny_checkpoint, threads=1).generate(list(prompts.values()), params))}
    monkeypatch.setattr(ModelRunner, "asynchronous", property(lambda self: True))

    async def main():
        client = await EngineClient.start(config(tiny_checkpoint, in_process=True))
        try:
            idle = client.stats().num_free_blocks
            long = client.add_request("long", [5, 6], SamplingParams(max_tokens=400, ignore_eos=True))
            await long.__anext__()
            streams = [collect(client, rid, ids, params) for rid, ids in prompts.items()]
            joined = await asyncio.gather(*streams)
            await long.aclose()
            for _ in range(100):
                await asyncio.sleep(0.01)
                if client.stats().num_running == 0 and client.stats().num_free_blocks == idle:
                    break
            return dict(zip(prompts, joined)), client.stats().num_free_blocks == idle
        finally:
            await client.shutdown()

    deltas, freed = asyncio.run(main())
    for rid, want in offline.items():
        mine = [d.outputs[0] for d in deltas[rid]]
        assert [t for o in mine for t in o.token_ids] == want.token_ids
        assert "".join(o.text for o in mine) == want.text
        # The long request shares the batch here and not offline: logprobs match to rounding.
        got = [lp.logprob for o in mine for lp in o.logprobs]
        assert got == pytest.approx([lp.logprob for lp in want.logprobs], abs=1e-4)
        assert [o.finish_reason for o in mine if o.finish_reason] == ["length"]
    assert freed
