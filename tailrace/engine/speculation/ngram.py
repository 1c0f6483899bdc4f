"""Prompt lookup: the tokens that followed the last earlier occurrence of the sequence's suffix."""

from __future__ import annotations

from tailrace.engine.sequence import Sequence


class NgramIndex:
    """Where each n-gram of one sequence (n from `low` to `high`) last ended, kept up to date as
    the sequence grows. Each call indexes only the tokens added since the last one and looks up
    one suffix per n, so the work per step does not grow with the sequence."""

    __slots__ = ("low", "high", "_last_end", "_indexed")

    def __init__(self, low: int, high: int) -> None:
        self.low, self.high = low, high
        self._last_end: list[dict[tuple[int, ...], int]] = [{} for _ in range(low, high + 1)]
        self._indexed = 0  # every n-gram ending at or before this position is indexed

    def propose(self, seq: Sequence, k: int) -> list[int]:
        """k tokens that followed the latest earlier occurrence of the longest suffix (of `low`
        to `high` tokens) that occurred before; [] where none did."""
        length = seq.num_tokens
        # n-grams ending before the last token, so that a match has at least one token after it
        for end in range(self._indexed + 1, length):
            window = seq.token_slice(max(0, end - self.high), end)
            for n, table in zip(range(self.low, self.high + 1), self._last_end):
                if n <= len(window):
                    table[tuple(window[len(window) - n:])] = end
        self._indexed = max(self._indexed, length - 1)
        suffix = seq.token_slice(max(0, length - self.high), length)
        for n in range(min(self.high, len(suffix)), self.low - 1, -1):
            end = self._last_end[n - self.low].get(tuple(suffix[len(suffix) - n:]))
            if end is not None:
                # A match that ends less than k before the end overlaps the suffix: the text
                # repeats with period length - end, and the guess goes on repeating it.
                span = seq.token_slice(end, min(end + k, length))
                return [span[i % len(span)] for i in range(k)]
        return []


class NgramProposer:
    """Each guessing sequence's index, kept while it runs."""

    def __init__(self, low: int, high: int) -> None:
        self.low, self.high = low, high
        self._indexes: dict[int, NgramIndex] = {}

    def propose(self, asks: list[tuple[Sequence, int]]) -> dict[int, list[int]]:
        """Up to k guesses for each (sequence, k) that has an earlier occurrence to follow."""
        drafts = {}
        for seq, k in asks:
            index = self._indexes.get(seq.seq_id)
            if index is None:
                index = self._indexes[seq.seq_id] = NgramIndex(self.low, self.high)
            if draft := index.propose(seq, k):
                drafts[seq.seq_id] = draft
        return drafts

    def drop(self, seq_id: int) -> None:
        self._indexes.pop(seq_id, None)
