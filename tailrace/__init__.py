"""tailrace: an OpenAI-compatible LLM inference server with exact streaming."""

from tailrace.outputs import CompletionOutput, RequestOutput, TokenLogprob
from tailrace.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "TokenLogprob"]
__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    """LLM on first use: it brings the engine and PyTorch, which the API process never loads."""
    if name == "LLM":
        from tailrace.llm import LLM

        return LLM
    raise AttributeError(f"module 'tailrace' has no attribute {name!r}")
