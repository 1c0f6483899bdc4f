"""Offline generation with the names vLLM users know: `LLM(...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import weakref
from collections.abc import Sequence as Seq

from tailrace.engine.config import EngineConfig
from tailrace.engine.core import EngineCore, EngineRequest, SeqOutput
from tailrace.engine.output_processor import OutputProcessor
from tailrace.outputs import CompletionOutput, RequestOutput
from tailrace.sampling_params import SamplingParams
from tailrace.tokenizer import load_tokenizer

Prompt = str | list[int]


class LLM:
    """The engine core on this thread. `model`: a Hugging Face directory, a .gguf file or a hub id
    (`revision=` pins one); None is the embedded tiny model."""

    def __init__(self, model: str | None = None, **engine_args: object) -> None:
        self.config = EngineConfig.from_kwargs(model, **engine_args)
        self.core = EngineCore(self.config)
        # The tensor-parallel workers end with this object, or at exit, if shutdown() is never called.
        self._shutdown = weakref.finalize(self, self.core.shutdown)
        self.tokenizer = load_tokenizer(self.config.model_path)

    def shutdown(self) -> None:
        """End the tensor-parallel worker processes (tensor_parallel_size > 1); generate no more after."""
        self._shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def generate(self, prompts: Prompt | Seq[Prompt],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None) -> list[RequestOutput]:
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError("give one SamplingParams, or one per prompt")
        processor = OutputProcessor(self.tokenizer)
        results: dict[str, RequestOutput] = {}
        for i, (prompt, params) in enumerate(zip(prompts, sampling_params)):
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            request_id = str(i)
            processor.add_request(request_id, ids, params)
            self.core.add_request(EngineRequest(request_id, ids, params))
            results[request_id] = RequestOutput(
                request_id, ids, [CompletionOutput(j, logprobs=[] if params.logprobs is not None else None)
                                  for j in range(params.n)],
                prompt=prompt if isinstance(prompt, str) else None)
        unprocessed: list[SeqOutput] = []  # on CUDA, a step's outputs are detokenized during the next
        while self.core.has_work() or unprocessed:
            step = self.core.launch() if self.core.has_work() else None
            self._process(processor, unprocessed, results)
            unprocessed = [] if step is None else self.core.collect(step)
            if not self.core.runner.asynchronous:
                self._process(processor, unprocessed, results)
                unprocessed = []
        return list(results.values())

    def _process(self, processor: OutputProcessor, outputs: list[SeqOutput],
                 results: dict[str, RequestOutput]) -> None:
        processed = processor.process(outputs)
        for request_id, sibling in processed.to_abort:
            self.core.abort(request_id, [sibling])
        for delta in processed.deltas:
            _accumulate(results[delta.request_id], delta)


def _accumulate(whole: RequestOutput, delta: RequestOutput) -> None:
    part = delta.outputs[0]
    out = whole.outputs[part.index]
    out.text += part.text
    out.token_ids.extend(part.token_ids)
    if out.logprobs is not None and part.logprobs:
        out.logprobs.extend(part.logprobs)
    if part.finish_reason is not None:
        out.finish_reason, out.stop_reason = part.finish_reason, part.stop_reason
    if delta.prompt_logprobs is not None:
        whole.prompt_logprobs = delta.prompt_logprobs
    whole.num_cached_tokens = max(whole.num_cached_tokens, delta.num_cached_tokens)
    whole.finished = delta.finished or whole.finished
