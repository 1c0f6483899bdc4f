"""The engine core: schedule -> run the model -> sample -> emit token ids. It never sees text."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from tailrace.engine.block_manager import BlockManager
from tailrace.engine.structured_output.closing import FORCED_LOGPROB
from tailrace.engine.config import EngineConfig
from tailrace.engine.messages import EngineRequest, SeqOutput
from tailrace.engine.model_runner import LaunchedStep, ModelRunner, StepResult
from tailrace.engine.sampler import make_generator, replay_draws
from tailrace.engine.scheduler import ScheduledSeq, Scheduler
from tailrace.engine.sequence import Sequence, Status
from tailrace.engine.speculation.draft_model import DraftModel
from tailrace.engine.speculation.ngram import NgramProposer
from tailrace.engine.speculation.speculator import Speculator, accepted_count
from tailrace.engine.structured_output.grammar import GrammarCompiler
from tailrace.engine.tensor_parallel.group import start_ranks
from tailrace.engine.stats import EngineStats
from tailrace.outputs import TokenLogprob
from tailrace.sampling_params import SamplingParams

log = logging.getLogger("tailrace.engine")


class BudgetTooSmall(ValueError):
    """max_tokens (or the context left) is below the shortest document the response format allows."""

    param = "max_tokens"

    def __init__(self, minimum: int, max_tokens: int, by_context: bool) -> None:
        given = (f"only {max_tokens} tokens are left in the context" if by_context
                 else f"max_tokens is {max_tokens}")
        super().__init__(f"The shortest answer that follows the response format takes {minimum} tokens, but "
                         f"{given}; set max_tokens to at least {minimum}.")


def forced_logprob(sampled: TokenLogprob, forced: int) -> TokenLogprob:
    """The logprob of a token the budget put in place of the sampled one: from the top
    alternatives when it is among them."""
    value = next((lp for t, lp in sampled.top if t == forced), FORCED_LOGPROB)
    return TokenLogprob(value, sampled.top)


@dataclass(slots=True)
class PendingStep:
    """A scheduled step on its way through the model (see EngineCore.launch)."""

    scheduled: list[ScheduledSeq]
    launched: LaunchedStep


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        config.validate()
        self.config = config
        tp = start_ranks(config) if config.tensor_parallel_size > 1 else None
        try:
            self.runner = ModelRunner(config, tp)
        except BaseException:
            if tp is not None:
                tp.kill()
            raise
        self.max_model_len = self.runner.max_model_len
        whole = not self.runner.keeps_kv
        if whole and self.runner.step_tokens > config.max_num_batched_tokens:
            log.info("each prompt runs whole in one step, keeping no K/V: a step holds up to %d tokens, the context",
                     self.runner.step_tokens)
        self.eos_token_ids = self.runner.model_config.eos_token_ids  # config.json + generation_config.json
        states = self.runner.cache.states  # a hybrid's: its prefixes end where their states are kept
        self.blocks = BlockManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching,
                                   None if states is None else states.kept)
        self.scheduler = Scheduler(self.blocks, config.max_num_seqs, self.runner.step_tokens, whole_prompts=whole)
        self.grammars = GrammarCompiler(config.model_path, self.runner.model_config.vocab_size, self.eos_token_ids)
        self.speculator = self._speculator(config)
        self.requests: dict[str, list[Sequence]] = {}
        self._next_seq_id = 0

    def _speculator(self, config: EngineConfig) -> Speculator | None:
        spec = config.speculative_config
        if spec is None:
            return None
        if not self.runner.keeps_kv:
            log.info("speculative decoding is off: this engine only pools")
            return None
        if self.runner.model_config.gated_delta_layers:
            log.warning("speculative decoding is off: a rejected guess cannot be taken back out of the Gated "
                        "DeltaNet layers' state")
            return None
        if spec.method == "ngram":
            proposer = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
            how = f"suffixes of {spec.prompt_lookup_min} to {spec.prompt_lookup_max} tokens looked up"
        else:
            proposer = DraftModel(spec.model, config, self.runner.model_config.vocab_size, self.max_model_len)
            how = f"guessed by {spec.model}, on its own KV cache of {proposer.runner.num_blocks} blocks"
        inexact = self.runner.backends.inexact()
        log.info("speculative decoding: %s, up to %d tokens a step, %s; %s", spec.method,
                 spec.num_speculative_tokens, how,
                 "the tokens and logprobs are plain decoding's, bit for bit" if inexact is None else
                 f"tokens and logprobs may differ from plain decoding's in the last bits: {inexact}")
        return Speculator(spec, self.max_model_len, proposer)

    def add_request(self, req: EngineRequest) -> None:
        """Queue a request as params.n sibling sequences; ValueError if it can never run."""
        prompt_len = len(req.prompt_token_ids)
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already running")
        if prompt_len == 0:
            raise ValueError("the prompt is empty")
        if prompt_len > self.max_model_len:
            raise ValueError(f"the prompt has {prompt_len} tokens, over the limit of {self.max_model_len}")
        vocab = self.runner.model_config.vocab_size
        if any(not 0 <= t < vocab for t in req.prompt_token_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        params = req.params
        if params.pooling is not None and self.config.tensor_parallel_size > 1:
            # rank 0 would keep more rows of the last layer than the ranks it sends the step to
            raise ValueError("pooling runs on one rank: serve the embedding model without tensor parallelism")
        if params.pooling is None and not self.runner.model_config.causal:
            raise ValueError("this model is an encoder: it embeds or scores, and cannot generate")
        if params.pooling is None and not self.runner.keeps_kv:
            raise ValueError("this engine only pools (embeds or scores): it keeps no K/V to generate with")
        if params.pooling == "score" and not self.runner.model_config.num_labels:
            raise ValueError("this model has no classifier to score with")
        if params.pooling == "logits" and self.runner.model.logit_score is None:
            raise ValueError("this model has no LogitScore module to score with")
        room = self.max_model_len - prompt_len
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        needed = -(-(prompt_len + max_tokens) // self.config.block_size)
        # n siblings share the prompt's full blocks (prefix caching) and each needs its own rest.
        shared = prompt_len // self.config.block_size if self.config.enable_prefix_caching else 0
        total = shared + params.n * (needed - shared)
        if total > self.runner.num_blocks:
            raise ValueError(f"the request needs {total} KV blocks for its {params.n} choice(s) but the cache has "
                             f"{self.runner.num_blocks}; lower n or max_tokens, or shorten the prompt")
        grammars = [self.grammars.for_sequence(params) for _ in range(params.n)]
        closing = grammars[0].closing if grammars[0] is not None else None
        if closing is not None and closing.minimum is not None and max_tokens < closing.minimum:
            raise BudgetTooSmall(closing.minimum, max_tokens, params.max_tokens is None or params.max_tokens > room)
        siblings = []
        for j in range(params.n):
            seed = None if params.seed is None else params.seed + j
            seq = Sequence(self._next_seq_id, req.request_id, j, req.prompt_token_ids, params, max_tokens,
                           generator=None if seed is None else make_generator(seed), grammar=grammars[j])
            self._next_seq_id += 1
            if j > 0 and params.prompt_logprobs is None:
                seq.waits_for = siblings[0]
            siblings.append(seq)
            self.scheduler.add(seq)
        self.requests[req.request_id] = siblings

    def abort(self, request_id: str, siblings: list[int] | None = None) -> list[SeqOutput]:
        """Drop a request (or some of its choices) now; its KV memory is free when this returns."""
        outputs = []
        for seq in self.requests.get(request_id, []):
            if seq.status is not Status.FINISHED and (siblings is None or seq.sibling in siblings):
                seq.finish_reason = "abort"
                self._finish(seq)
                outputs.append(SeqOutput(request_id, seq.sibling, finish_reason="abort"))
        return outputs

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[SeqOutput]:
        step = self.launch()
        return [] if step is None else self.collect(step)

    def launch(self) -> PendingStep | None:
        """Schedule a step and queue it on the model; None when nothing can run now.

        On CUDA this returns while the device computes, and until `collect` the caller may add
        requests and abort them (an aborted sequence's result is dropped); it must not launch again.
        """
        drafts = self.speculator.propose(self.scheduler.running) if self.speculator is not None else None
        sched = self.scheduler.schedule(drafts)
        for seq in sched.preempted:
            self.runner.release(seq.seq_id)
            if not seq.prompt_logprobs_sent:
                seq.prompt_logprobs = None
        if not sched.scheduled:
            return None
        return PendingStep(sched.scheduled, self.runner.launch(sched.scheduled, self.eos_token_ids))

    def collect(self, step: PendingStep) -> list[SeqOutput]:
        """Wait for the launched step and apply its tokens: what each sequence gained."""
        results = self.runner.collect(step.launched)
        outputs: list[SeqOutput] = []
        for item, res in zip(step.scheduled, results):
            seq, reached_end = item.seq, item.samples
            if seq.status is Status.FINISHED:
                continue  # aborted while the step ran
            out = SeqOutput(seq.request_id, seq.sibling, num_cached_tokens=seq.num_cached_tokens)
            if item.draft:
                self._keep_guess(item, res, out)
            else:
                seq.num_computed_tokens += item.num_new_tokens
            self.blocks.register_full_blocks(seq)
            if res.prompt_logprobs is not None:
                seq.prompt_logprobs = (seq.prompt_logprobs or []) + res.prompt_logprobs
            if seq.wants_prompt_logprobs and seq.num_computed_tokens >= seq.num_prompt_tokens:
                out.prompt_logprobs = seq.prompt_logprobs or []
                seq.prompt_logprobs_sent = True
            if res.embedding is not None:
                out.embedding, seq.finish_reason = res.embedding, "stop"
            elif res.token_ids and not item.draft:
                self._append(seq, res.token_ids[0], res.logprobs[0], out)
            elif reached_end and seq.max_tokens == 0:
                seq.finish_reason = "length"
            if seq.finish_reason is not None:
                out.finish_reason, out.stop_reason = seq.finish_reason, seq.stop_reason
                self._finish(seq)
            if out.new_token_ids or out.finish_reason or out.prompt_logprobs is not None:
                outputs.append(out)
        return outputs

    def _keep_guess(self, item: ScheduledSeq, res: StepResult, out: SeqOutput) -> None:
        """Append what plain decoding would have: the token sampled at each guessed position, up to
        the first that is not the guess's own (or that the grammar's closing replaces), and that
        one. The K/V of the known token and of each guessed token kept before the last stands (a
        rejected guess's stays in its slots, unused, until a later token overwrites it); a seeded
        generator is left where that many draws leave it."""
        seq = item.seq
        accepted = accepted_count(res.token_ids, item.draft)
        kept = 0
        for token, logprob in zip(res.token_ids[:accepted + 1], res.logprobs):
            appended = self._append(seq, token, logprob, out)
            kept += 1
            if seq.finish_reason is not None or appended != token:
                break
        seq.num_computed_tokens += kept
        if res.rng_state is not None and kept < len(res.token_ids):
            replay_draws(seq.generator, res.rng_state, kept)
        self.speculator.record(seq, len(item.draft), kept - 1)

    def _append(self, seq: Sequence, token: int, logprob: TokenLogprob | None, out: SeqOutput) -> int:
        """Append the sampled `token` (or the token the grammar's closing puts in its place, which
        is returned) and apply the finish rules."""
        if seq.grammar is not None:
            chosen = seq.grammar.choose(token, seq.max_tokens - len(seq.output_token_ids) - 1)
            if chosen != token:
                token, logprob = chosen, None if logprob is None else forced_logprob(logprob, chosen)
            seq.grammar.accept(token)
        seq.output_token_ids.append(token)
        out.new_token_ids.append(token)
        if seq.params.logprobs is not None and logprob is not None:
            if out.new_logprobs is None:
                out.new_logprobs = []
            out.new_logprobs.append(logprob)
        params = seq.params
        if token in self.eos_token_ids and not params.ignore_eos:
            seq.finish_reason = "stop"
        elif token in params.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", token
        elif len(seq.output_token_ids) >= seq.max_tokens or seq.num_tokens >= self.max_model_len:
            seq.finish_reason = "length"
        return token

    def _finish(self, seq: Sequence) -> None:
        seq.grammar = None
        if self.speculator is not None:
            self.speculator.drop(seq.seq_id)
        self.scheduler.finish(seq)
        self.runner.release(seq.seq_id)
        siblings = self.requests.get(seq.request_id, [])
        if all(s.status is Status.FINISHED for s in siblings):
            self.requests.pop(seq.request_id, None)

    def shutdown(self) -> None:
        """End the other tensor-parallel ranks, if any; the core cannot step after this."""
        self.runner.shutdown()

    def stats(self) -> EngineStats:
        stats = EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            num_total_blocks=self.blocks.num_blocks, num_free_blocks=self.blocks.num_free_blocks,
            kv_usage=1.0 - self.blocks.num_free_blocks / self.blocks.num_blocks,
            prefix_cache_queries=self.blocks.prefix_cache_queries,
            prefix_cache_hits=self.blocks.prefix_cache_hits,
            num_preemptions=self.scheduler.num_preemptions,
        )
        if self.speculator is not None:
            spec = self.speculator.stats
            stats.spec_num_drafts, stats.spec_num_draft_tokens = spec.num_drafts, spec.num_draft_tokens
            stats.spec_num_accepted_tokens = spec.num_accepted_tokens
            stats.spec_accepted_per_position = list(spec.accepted_per_position)
        return stats

