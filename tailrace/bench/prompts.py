"""Random-text prompts of about a given token length, built from a fixed list of common English words.

Real words (not random token ids) keep the prompts valid text for any tokenizer and any server;
the token length is only known through a tokens-per-word ratio, measured with the server's
`/tokenize` when it has one (see `serve.calibrate`) and assumed otherwise.
"""

from __future__ import annotations

import random

# Common short words: most are one token in any BPE vocabulary that has seen English.
WORDS = tuple("""
the of and to in is was that for on with as by at from his her they this had not are but
which have one you were all we she there been their has more when will would who so no if
out up said what its about than into them can only other time new some could these two may
first then do any like my now over such our man me even most made after also did many off
before must well back through years much where your way down should because each just those
people how too little state good very make world still own see men work long get here between
both life being under never day same another know while last might us great old year come
since against go came right used take three small place house water river stone field light
green sound night word city tree road table window garden morning letter paper music story
bread summer winter market bridge mountain island forest village station kitchen harbor
""".split())

# English prose runs about 1.3 tokens a word in the common BPE vocabularies (0.75 words a token).
DEFAULT_TOKENS_PER_WORD = 1.3


def words_for(input_len: int, tokens_per_word: float) -> int:
    """How many words make a prompt of about `input_len` tokens."""
    return max(1, round(input_len / tokens_per_word))


def random_text(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


def make_prompts(num_prompts: int, input_len: int, seed: int,
                 tokens_per_word: float = DEFAULT_TOKENS_PER_WORD) -> list[str]:
    """`num_prompts` different random texts; the same seed gives the same prompts."""
    rng = random.Random(seed)
    num_words = words_for(input_len, tokens_per_word)
    return [random_text(rng, num_words) for _ in range(num_prompts)]
