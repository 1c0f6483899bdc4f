"""A string `pattern` as a small DFA that knows, from each state, the shortest text that ends it.

JSON Schema patterns search (`"ab"` matches `"zzabzz"`); only anchored ones (`^...$`) say what
the whole string is, so only those are taken. The subset is what a DFA over printable ASCII can
hold: literals, escapes, `\\d`, `\\w`, classes with ranges, groups, `|`, `?`, `*`, `+`, `{m,n}`.
The characters `"` and `\\` (which JSON writes escaped) and anything else raise `Unsupported`.
"""

from __future__ import annotations

from collections import deque

PRINTABLE = frozenset(range(0x20, 0x7F)) - {ord('"'), ord("\\")}
_DIGITS = frozenset(range(ord("0"), ord("9") + 1))
_WORD = _DIGITS | frozenset(range(ord("a"), ord("z") + 1)) | frozenset(range(ord("A"), ord("Z") + 1)) | {ord("_")}
_MAX_REPEAT = 64  # {m,n} bounds beyond this would make the automaton large
_MAX_STATES = 2000


class Unsupported(ValueError):
    """A schema feature the closer cannot complete correctly."""


class _Nfa:
    """Thompson NFA: edges[s] holds (byte set or None for epsilon, target)."""

    def __init__(self) -> None:
        self.edges: list[list[tuple[frozenset[int] | None, int]]] = []

    def state(self) -> int:
        self.edges.append([])
        return len(self.edges) - 1

    def closure(self, states: set[int]) -> frozenset[int]:
        todo, seen = list(states), set(states)
        while todo:
            for chars, target in self.edges[todo.pop()]:
                if chars is None and target not in seen:
                    seen.add(target)
                    todo.append(target)
        return frozenset(seen)


class _Parser:
    """Recursive descent over the pattern; each method returns an NFA fragment (start, end)."""

    def __init__(self, pattern: str, nfa: _Nfa) -> None:
        self.text, self.pos, self.nfa = pattern, 0, nfa

    def peek(self) -> str | None:
        return self.text[self.pos] if self.pos < len(self.text) else None

    def take(self) -> str:
        if self.pos >= len(self.text):
            raise Unsupported("pattern ends early")
        self.pos += 1
        return self.text[self.pos - 1]

    def alternation(self) -> tuple[int, int]:
        branches = [self.sequence()]
        while self.peek() == "|":
            self.take()
            branches.append(self.sequence())
        if len(branches) == 1:
            return branches[0]
        start, end = self.nfa.state(), self.nfa.state()
        for s, e in branches:
            self.nfa.edges[start].append((None, s))
            self.nfa.edges[e].append((None, end))
        return start, end

    def sequence(self) -> tuple[int, int]:
        start = end = self.nfa.state()
        while self.peek() not in (None, "|", ")"):
            s, e = self.quantified()
            self.nfa.edges[end].append((None, s))
            end = e
        return start, end

    def quantified(self) -> tuple[int, int]:
        begin = self.pos
        atom = self.atom()
        atom_text = self.text[begin:self.pos]
        low, high = self.quantifier()
        if (low, high) == (1, 1):
            return atom
        # Each further copy is a fresh fragment parsed again from the atom's own text.
        count = low + (1 if high is None else high - low)
        copies = [atom] + [_Parser(atom_text, self.nfa).atom() for _ in range(count - 1)]
        start = end = self.nfa.state()
        for s, e in copies[:low]:
            self.nfa.edges[end].append((None, s))
            end = e
        if high is None:  # a loop state: through the last copy and back, any number of times
            s, e = copies[-1]
            loop = self.nfa.state()
            self.nfa.edges[end].append((None, loop))
            self.nfa.edges[loop].append((None, s))
            self.nfa.edges[e].append((None, loop))
            return start, loop
        for s, e in copies[low:]:
            after = self.nfa.state()
            self.nfa.edges[end] += [(None, s), (None, after)]
            self.nfa.edges[e].append((None, after))
            end = after
        return start, end

    def quantifier(self) -> tuple[int, int | None]:
        c = self.peek()
        if c in ("?", "*", "+"):
            self.take()
            result: tuple[int, int | None] = {"?": (0, 1), "*": (0, None), "+": (1, None)}[c]
        elif c == "{":
            self.take()
            body = ""
            while self.peek() != "}":
                body += self.take()
            self.take()
            low_text, comma, high_text = body.partition(",")
            if not low_text.isdigit() or (high_text and not high_text.isdigit()):
                raise Unsupported(f"quantifier {{{body}}}")
            low = int(low_text)
            high = low if not comma else (int(high_text) if high_text else None)
            if max(low, high or 0) > _MAX_REPEAT or (high is not None and high < low):
                raise Unsupported(f"quantifier {{{body}}}")
            result = (low, high)
        else:
            return 1, 1
        if self.peek() in ("?", "+", "*", "{"):
            raise Unsupported("lazy, possessive or stacked quantifiers")
        return result

    def atom(self) -> tuple[int, int]:
        c = self.take()
        if c == "(":
            if self.text.startswith("?:", self.pos):
                self.pos += 2
            elif self.peek() == "?":
                raise Unsupported("group extensions")
            fragment = self.alternation()
            if self.take() != ")":
                raise Unsupported("unbalanced group")
            return fragment
        if c == "[":
            return self._chars(self._class())
        if c == "\\":
            return self._chars(self._escape(self.take()))
        if c in ".^$)|?*+{}":
            raise Unsupported(f"{c!r} in a pattern")
        return self._chars(_checked({ord(c)}))

    def _chars(self, chars: frozenset[int]) -> tuple[int, int]:
        start, end = self.nfa.state(), self.nfa.state()
        self.nfa.edges[start].append((chars, end))
        return start, end

    def _class(self) -> frozenset[int]:
        if self.peek() == "^":
            raise Unsupported("negated character classes")
        chars: set[int] = set()
        while (c := self.take()) != "]":
            if c == "\\":
                chars |= self._escape(self.take())
                continue
            if self.peek() == "-" and self.text[self.pos + 1:self.pos + 2] not in ("]", ""):
                self.take()
                last = self.take()
                chars |= set(range(ord(c), ord(last) + 1))
            else:
                chars.add(ord(c))
        return _checked(chars)

    def _escape(self, c: str) -> frozenset[int]:
        if c == "d":
            return _DIGITS
        if c == "w":
            return _WORD
        if c.isalnum():
            raise Unsupported(f"escape \\{c}")
        return _checked({ord(c)})


def _checked(chars: set[int]) -> frozenset[int]:
    if not chars or not chars <= PRINTABLE:
        raise Unsupported("characters outside printable ASCII (or quote, backslash) in a pattern")
    return frozenset(chars)


class PatternDfa:
    """Deterministic states over bytes; `dist[s]` is the length of the shortest ending from s and
    `ending(s)` that text. State 0 is the start; DEAD refuses everything."""

    DEAD = -1

    def __init__(self, pattern: str) -> None:
        if not (pattern.startswith("^") and pattern.endswith("$") and not pattern.endswith("\\$")):
            raise Unsupported("patterns must be anchored with ^ and $")
        nfa = _Nfa()
        parser = _Parser(pattern[1:-1], nfa)
        # A top-level `|` would bind the anchors to its branches (`^a|b$`), so it is not taken.
        start, accept = parser.sequence()
        if parser.peek() == "|":
            raise Unsupported("a top-level | in a pattern (group the branches)")
        if parser.pos != len(parser.text):
            raise Unsupported("unbalanced group")
        self.trans: list[dict[int, int]] = []
        self.accepting: list[bool] = []
        self._build(nfa, start, accept)
        self.dist, self._next = self._distances()
        if self.dist[0] < 0:
            raise Unsupported("the pattern matches nothing")

    def _build(self, nfa: _Nfa, start: int, accept: int) -> None:
        first = nfa.closure({start})
        index = {first: 0}
        todo = deque([first])
        self.trans.append({})
        self.accepting.append(accept in first)
        while todo:
            current = todo.popleft()
            moves: dict[int, set[int]] = {}
            for s in current:
                for chars, target in nfa.edges[s]:
                    for b in chars or ():
                        moves.setdefault(b, set()).add(target)
            row = self.trans[index[current]]
            for b, targets in moves.items():
                nxt = nfa.closure(targets)
                if nxt not in index:
                    if len(index) >= _MAX_STATES:
                        raise Unsupported("the pattern is too large to complete")
                    index[nxt] = len(self.trans)
                    self.trans.append({})
                    self.accepting.append(accept in nxt)
                    todo.append(nxt)
                row[b] = index[nxt]

    def _distances(self) -> tuple[list[int], list[int]]:
        n = len(self.trans)
        dist, nxt = [-1] * n, [-1] * n
        reverse: list[list[tuple[int, int]]] = [[] for _ in range(n)]
        for s, row in enumerate(self.trans):
            for b, t in sorted(row.items()):
                reverse[t].append((s, b))
        todo = deque(s for s in range(n) if self.accepting[s])
        for s in todo:
            dist[s] = 0
        while todo:
            t = todo.popleft()
            for s, b in reverse[t]:
                if dist[s] < 0:
                    dist[s], nxt[s] = dist[t] + 1, b
                    todo.append(s)
        return dist, nxt

    def step(self, state: int, byte: int) -> int:
        return self.DEAD if state == self.DEAD else self.trans[state].get(byte, self.DEAD)

    def ending(self, state: int) -> bytes:
        """The shortest bytes that take `state` to an accepting one."""
        out = bytearray()
        while not self.accepting[state]:
            out.append(self._next[state])
            state = self.trans[state][self._next[state]]
        return bytes(out)

