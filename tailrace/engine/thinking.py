"""Where a thinking model's answer starts, read from token ids alone.

The engine core (which applies a grammar to the answer only) and the detokenizer (which looks
for stop strings in the answer only) follow the same rule, so they agree on the boundary.
"""

from __future__ import annotations

from enum import Enum

from tailrace.sampling_params import ThinkTokens


class Phase(Enum):
    UNDECIDED = "undecided"  # nothing generated yet; the first token says whether it thinks
    THINKING = "thinking"
    ANSWERING = "answering"


class ThinkGate:
    """Follows one sequence's generated tokens: thinking until the close id, then the answer."""

    __slots__ = ("_tokens", "phase")

    def __init__(self, tokens: ThinkTokens) -> None:
        self._tokens = tokens
        self.phase = Phase.THINKING if tokens.open_at_start else Phase.UNDECIDED

    @property
    def open_id(self) -> int:
        return self._tokens.open_id

    @property
    def answering(self) -> bool:
        return self.phase is Phase.ANSWERING

    def feed(self, token_id: int) -> bool:
        """Take the next generated token; True when it belongs to the answer. The tags themselves
        never do."""
        if self.phase is Phase.UNDECIDED:
            self.phase = Phase.THINKING if token_id == self._tokens.open_id else Phase.ANSWERING
            return self.phase is Phase.ANSWERING
        if self.phase is Phase.THINKING:
            if token_id == self._tokens.close_id:
                self.phase = Phase.ANSWERING
            return False
        return True
