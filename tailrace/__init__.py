"""tailrace: an OpenAI-compatible LLM inference server with exact streaming."""

from tailrace.llm import LLM
from tailrace.outputs import CompletionOutput, RequestOutput, TokenLogprob
from tailrace.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "TokenLogprob"]
__version__ = "0.1.0"
