"""Serving benchmarks: a streamed load generator for any OpenAI-compatible server (`serve`), and
tailrace measured next to `transformers serve` on one machine (`compare`)."""
