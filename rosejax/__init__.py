"""rosejax: a GPT-2 inference engine in JAX, Flax and Pallas."""

from rosejax.engine import LLMEngine
from rosejax.llm import LLM
from rosejax.request import RequestOutput
from rosejax.sampling import SamplingParams

__all__ = ["LLM", "LLMEngine", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
