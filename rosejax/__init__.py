"""rosejax: an LLM inference engine in JAX, Flax and Pallas. Importing it changes nothing in the
process: the entry points (`LLM`, `LLMEngine`, the CLIs) set XLA flags and the compilation cache."""

from rosejax.engine.llm_engine import LLMEngine
from rosejax.engine.request import RequestOutput
from rosejax.llm import LLM
from rosejax.sampling import SamplingParams
from rosejax.settings import EngineConfig, KernelConfig

__all__ = ["LLM", "EngineConfig", "KernelConfig", "LLMEngine", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
