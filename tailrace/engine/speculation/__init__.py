"""Speculative decoding: a proposer guesses a sequence's next tokens (`ngram`), the model checks
them all in one step, and only the tokens plain decoding would have produced are kept.
`speculator` decides per sequence how many to guess, judges the guesses, and counts them."""
