"""Grammar-constrained decoding with llguidance: each constrained sequence has a matcher that
says which tokens may come next, and the sampler only sees those.

Why llguidance: a 3 MB abi3 wheel with no Python dependencies that builds its tokenizer straight
from tokenizer.json and fills masks with the GIL released. On the embedded model it imports in
30 ms (xgrammar 0.2.9: 2.7 s, as it loads transformers; it also requires triton), compiles a
five-object schema in 8 ms (xgrammar 9.5 ms) and fills an 8k-token mask in about 15 us.

The per-step cost lands only on constrained rows: masks for them are filled on a worker thread
while the model runs on a device, or after the forward on CPU (`MaskJob`), and a step without a
constrained row does no grammar work.
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import numpy as np
import torch

from tailrace.engine.structured_output.closing import Closing, TokenTable
from tailrace.engine.structured_output.closing_schema import Node, compile_schema
from tailrace.engine.structured_output.json_grammar import json_grammar
from tailrace.engine.structured_output.regex_closing import Unsupported
from tailrace.engine.thinking import Phase, ThinkGate
from tailrace.engine.transfer import to_device
from tailrace.model.cpu.kernels import kernels
from tailrace.sampling_params import SamplingParams, StructuredSpec
from tailrace.tokenizer import tokenizer_json

_COMPILED_CACHE = 64  # schemas whose compiled matcher the core keeps for reuse
_LOG_SILENT = 0  # llguidance writes grammar errors to stderr otherwise; we read them from the matcher


class SequenceGrammar:
    """One sequence's matcher; with thinking tokens, it starts at the answer. `closing` keeps the
    answer finishable within the budget (None: a schema the closer cannot complete, or thinking,
    whose length the budget cannot plan for)."""

    __slots__ = ("matcher", "gate", "closing")

    def __init__(self, matcher: llguidance.LLMatcher, gate: ThinkGate | None, closing: Closing | None) -> None:
        self.matcher = matcher
        self.gate = gate
        self.closing = closing

    def choose(self, token_id: int, left_after: int) -> int:
        """The token to append when `token_id` was sampled with `left_after` tokens of budget
        after it: itself, or the next token of a valid ending that still fits."""
        if self.closing is None:
            return token_id
        chosen = self.closing.choose(token_id, left_after)
        if chosen is None or (chosen != token_id and self.matcher.validate_tokens([chosen]) != 1):
            self.closing = None  # the closer and the grammar disagree: the grammar goes on alone
            return token_id
        return chosen

    @property
    def constrains_next(self) -> bool:
        return self.gate is None or self.gate.phase is not Phase.THINKING

    @property
    def takes_guesses(self) -> bool:
        """Whether speculation may guess for it: without thinking, whose gate would have to follow
        the guess too."""
        return self.gate is None

    def guess_prefix(self, draft: list[int]) -> int:
        """How many of the draft's first tokens the grammar allows in a row; consumes none."""
        return self.matcher.validate_tokens(draft)

    def accept(self, token_id: int) -> None:
        """Advance past a sampled token. A token the grammar refused (possible only when another
        rule overrode the mask) leaves the matcher in its error state, which allows only eos."""
        if self.gate is None or self.gate.feed(token_id):
            self.matcher.consume_token(token_id)


class GrammarCompiler:
    """The core's compiled grammars: the llguidance tokenizer (built on first use, ~0.1 s for
    8k tokens) and a matcher per recent schema, copied for each sequence."""

    def __init__(self, model_path: str, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.model_path = model_path
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.close_within_budget = True  # False: today's grammar alone (bench/structured_throughput.py compares)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._table: TokenTable | None = None
        # Per schema: the compiled matcher, and the closer's reading (None: it cannot complete it).
        self._compiled: OrderedDict[str, tuple[llguidance.LLMatcher, Node | None]] = OrderedDict()

    def for_sequence(self, params: SamplingParams) -> SequenceGrammar | None:
        """A fresh matcher for one sequence of a constrained request; ValueError if it cannot compile."""
        if params.structured is None:
            return None
        compiled = self._compiled.get(params.structured.json_schema)
        if compiled is None:
            compiled = self._compile(params.structured)
        else:
            self._compiled.move_to_end(params.structured.json_schema)
        template, root = compiled
        gate = ThinkGate(params.thinking) if params.thinking is not None else None
        closes = self.close_within_budget and root is not None and gate is None
        closing = Closing(root, self.token_table()) if closes else None
        return SequenceGrammar(template.deep_copy(), gate, closing)

    def _compile(self, spec: StructuredSpec) -> tuple[llguidance.LLMatcher, Node | None]:
        matcher = llguidance.LLMatcher(self._llg_tokenizer(), json_grammar(spec), log_level=_LOG_SILENT)
        if matcher.is_error():
            raise ValueError(f"the response format cannot be enforced: {matcher.get_error()}")
        try:
            root = compile_schema(json.loads(spec.json_schema))
        except Unsupported:
            root = None
        self._compiled[spec.json_schema] = matcher, root
        if len(self._compiled) > _COMPILED_CACHE:
            self._compiled.popitem(last=False)
        return matcher, root

    def token_table(self) -> TokenTable:
        if self._table is None:
            tokenizer = self._llg_tokenizer()
            ids = range(self.vocab_size)
            self._table = TokenTable([tokenizer.decode_bytes([i]) for i in ids],
                                     {i for i in ids if tokenizer.is_special_token(i)})
        return self._table

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            source = tokenizer_json(self.model_path)
            try:
                # n_vocab is the model's: logits columns past the tokenizer's ids are then always masked.
                self._tokenizer = llguidance.LLTokenizer(source, n_vocab=self.vocab_size,
                                                         eos_token=self.eos_token_ids)
            except Exception as err:  # whatever llguidance raises, it refuses this request, not the engine
                raise ValueError(f"structured output is not available for this tokenizer: {err}") from err
        return self._tokenizer


class MaskWorker:
    """The model runner's thread for filling masks while the model runs on a device (started on
    first use). With `overlap` off (CPU) the engine thread fills them in line: a mask thread (and
    llguidance's own) beside the forward's threads on the same cores slowed every row, 16.5% off
    the unconstrained decode rate with 4 of 16 rows constrained against 6.0% filling in line. In
    line, as the step starts rather than after its forward: the grammars' tables are still in the
    caches from consuming the last tokens, so masks fill faster than after the forward
    (bench/structured_throughput.py measures the cost to unconstrained rows)."""

    def __init__(self, vocab_size: int, overlap: bool = True) -> None:
        self.vocab_size = vocab_size
        self.overlap = overlap
        self._pool: ThreadPoolExecutor | None = None
        self._executor: llguidance.LLExecutor | None = None

    def start(self, grammars: list[SequenceGrammar], guesses: list[list[int]] | None = None) -> MaskJob:
        """Begin filling the masks of these sequences' next tokens (without overlap: fill them now);
        with `guesses`, a grammar whose guess is not empty gets a mask for each of the guess's
        positions too (its rows follow one another)."""
        guesses = guesses or [[] for _ in grammars]
        if not self.overlap:
            return MaskJob(None, None, grammars, guesses, self.vocab_size)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tailrace-grammar")
            # llguidance spreads a batch over its own threads; on a small CPU one leaves the model its cores.
            self._executor = llguidance.LLExecutor(num_threads=max(1, min(8, (os.cpu_count() or 2) // 2)))
        return MaskJob(self._pool, self._executor, grammars, guesses, self.vocab_size)


def _fill_guessed(matcher: llguidance.LLMatcher, guess: list[int], at: int, row_bytes: int) -> None:
    """The masks at each position of a guess the grammar allows: the next token's, then each one
    after consuming the guess up to it; the matcher is rolled back to where it was."""
    for j in range(len(guess) + 1):
        matcher.unsafe_compute_mask_ptr(at + j * row_bytes, row_bytes)
        if j < len(guess):
            matcher.consume_token(guess[j])
    matcher.rollback(len(guess))


class MaskJob:
    """The allowed-token bitmasks of one step's constrained rows: a row of vocab/32 words per
    grammar, bit i of word w allowing token 32*w + i."""

    def __init__(self, pool: ThreadPoolExecutor | None, executor: llguidance.LLExecutor | None,
                 grammars: list[SequenceGrammar], guesses: list[list[int]], vocab_size: int) -> None:
        """With a pool the masks are filled on it; without, here, before this returns."""
        self.vocab_size = vocab_size
        firsts = np.cumsum([0] + [1 + len(g) for g in guesses]).tolist()
        self.bitmask = np.zeros((firsts[-1], (vocab_size + 31) // 32), dtype=np.uint32)
        self._done: Future | None = None
        if pool is not None:
            self._done = pool.submit(self._fill, executor, grammars, guesses, firsts)
        else:
            self._fill(None, grammars, guesses, firsts)

    def _fill(self, executor: llguidance.LLExecutor | None, grammars: list[SequenceGrammar],
              guesses: list[list[int]], firsts: list[int]) -> None:
        # llguidance writes each mask at base + k * row_bytes and releases the GIL while it works.
        base, row_bytes = self.bitmask.ctypes.data, self.bitmask.shape[1] * 4
        plain = [(g.matcher, firsts[k]) for k, g in enumerate(grammars) if not guesses[k]]
        if executor is not None and plain:
            executor.unsafe_compute_mask_ptr(plain, base, row_bytes, len(self.bitmask))
        else:
            for matcher, row in plain:
                matcher.unsafe_compute_mask_ptr(base + row * row_bytes, row_bytes)
        for k, grammar in enumerate(grammars):
            if guesses[k]:
                _fill_guessed(grammar.matcher, guesses[k], base + firsts[k] * row_bytes, row_bytes)
        for k, grammar in enumerate(grammars):
            if grammar.gate is not None and grammar.gate.phase is Phase.UNDECIDED:
                # Before the first token, the model may also open a think block.
                open_id = grammar.gate.open_id
                self.bitmask[firsts[k], open_id // 32] |= np.uint32(1 << (open_id % 32))

    def wait(self) -> np.ndarray:
        """The bitmask, once filled."""
        if self._done is not None:
            self._done.result()
        return self.bitmask

    def apply(self, logits: torch.Tensor, rows: list[int]) -> None:
        """Wait for the masks, then set every disallowed logit of `rows` (one per mask row, in
        order) to -inf in place."""
        self.wait()
        if logits.device.type == "cpu" and (ops := kernels()) is not None:
            ops.mask_tokens(logits, torch.from_numpy(self.bitmask.view(np.int32)), rows)
            return
        bits = np.unpackbits(self.bitmask.view(np.uint8), axis=1, bitorder="little")[:, :self.vocab_size]
        if logits.device.type == "cpu":
            # Row by row, each op stays under torch's grain for a parallel region, which on a busy
            # CPU waits for every thread's core: 4 rows of 8k took ~3 ms at once, 60 us this way.
            # Adding (bit - 1) * 2**23 read as float32 (0.0, or -inf's bit pattern) measured half the
            # time of masked_fill_ at 4 rows of 49k (118 against 218 us), with the same logits.
            bias = torch.from_numpy(bits).to(torch.int32).sub_(1).mul_(1 << 23).view(torch.float32)
            for k, row in enumerate(rows):
                logits[row].add_(bias[k])
            return
        allowed = to_device(torch.from_numpy(bits.view(np.bool_)), logits.device)
        index = to_device(rows, logits.device)
        logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
