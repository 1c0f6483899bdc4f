"""Structured output that ends within its token budget: a sampled token is taken only if a valid
document can still be finished in the tokens left after it; otherwise the next token of the
shortest ending is taken in its place.

The invariant, from the first token on: some valid completion fits in the tokens left. It holds
at the start (add_request refuses a budget under `minimum`), and each step keeps it: either the
sampled token leaves room (its ending, spelled in the fewest tokens, fits), or the plan's next
token is taken, whose rest fits by construction. Every byte is a token of a byte-level
vocabulary, so an ending of b bytes needs at most b tokens; only when that bound does not
settle it is the ending spelled out (`TokenTable.fewest`). A row further from its budget than
the schema's bound on any ending (`Node.bound`) does no closing work at all: its bytes wait
until the budget comes near.
"""

from __future__ import annotations

import math

from tailrace.engine.structured_output.closing_schema import Node
from tailrace.engine.structured_output.json_closing import Closer

_UTF8_BYTES = [b for b in range(256) if b not in (0xC0, 0xC1) and b < 0xF5]
# The logprob reported for a token the budget forced in place of the sampled one (vLLM's floor).
FORCED_LOGPROB = -9999.0


class TokenTable:
    """The vocabulary by bytes (special tokens left out), for spelling text in the fewest tokens."""

    def __init__(self, token_bytes: list[bytes], special: set[int]) -> None:
        self.token_bytes = token_bytes
        self.special = special
        self.ids: dict[bytes, int] = {}
        for token_id, data in enumerate(token_bytes):
            if data and token_id not in special:
                self.ids.setdefault(data, token_id)
        # Every start of a token's bytes: spelling stops looking further once none starts so.
        self.starts = {data[:k] for data in self.ids for k in range(1, len(data) + 1)}
        # Whether every byte that UTF-8 text can hold is a token of its own.
        self.every_byte = all(bytes([b]) in self.ids for b in _UTF8_BYTES)

    def fewest(self, data: bytes) -> list[int] | None:
        """The shortest token sequence whose bytes are `data` (None if none spells it)."""
        best: list[int | None] = [0] + [None] * len(data)  # tokens needed to spell data[:i]
        last = [0] * (len(data) + 1)  # where the last token of that spelling starts
        for start in range(len(data)):
            if best[start] is None:
                continue
            end = start + 1
            while end <= len(data) and data[start:end] in self.starts:
                if data[start:end] in self.ids and (best[end] is None or best[start] + 1 < best[end]):
                    best[end], last[end] = best[start] + 1, start
                end += 1
        if best[-1] is None:
            return None
        out, end = [], len(data)
        while end:
            out.append(self.ids[data[last[end]:end]])
            end = last[end]
        return out[::-1]


class Closing:
    """One sequence's closer and its plan: the tokens of a valid ending that fits the budget, or
    None while the ending's byte count alone shows that it fits. While the budget left is over
    the schema's bound on any ending, tokens are only queued (`pending`) for the closer."""

    __slots__ = ("closer", "plan", "table", "far", "pending")

    def __init__(self, root: Node, table: TokenTable) -> None:
        self.closer = Closer(root)
        self.table = table
        self.plan: list[int] | None = table.fewest(root.min_text)
        self.far = root.bound if table.every_byte else math.inf  # budgets from here up need no check
        self.pending = bytearray()

    @property
    def minimum(self) -> int | None:
        """The fewest tokens a whole document takes; None if the table cannot spell one."""
        return None if self.plan is None else len(self.plan)

    def choose(self, token: int, left_after: int) -> int | None:
        """The token to take when `token` was sampled and `left_after` tokens remain after it:
        `token` itself, or the plan's next token; None when the closer cannot follow (the
        grammar then goes on alone)."""
        if token in self.table.special:
            return token  # eos, which the grammar allows only once the document is whole
        data = self.table.token_bytes[token]
        if left_after >= self.far:
            self.pending += data
            self.plan = None
            return token
        if self.pending:
            fed = self.closer.feed(bytes(self.pending))
            self.pending.clear()
            if not fed:
                return None
        if self.plan and token == self.plan[0]:
            self.plan = self.plan[1:]
            self.closer.feed(data)
            return token
        trial = self.closer.copy()
        if trial.feed(data):
            ending = trial.ending()
            if ending is not None:
                if self.table.every_byte and len(ending) <= left_after:
                    self.closer, self.plan = trial, None
                    return token
                spelled = self.table.fewest(ending)
                if spelled is not None and len(spelled) <= left_after:
                    self.closer, self.plan = trial, spelled
                    return token
        if self.plan is None:
            ending = self.closer.ending()
            self.plan = None if ending is None else self.table.fewest(ending)
        if not self.plan:
            return None
        forced, self.plan = self.plan[0], self.plan[1:]
        self.closer.feed(self.table.token_bytes[forced])
        return forced
