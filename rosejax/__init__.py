"""rosejax: a GPT-2 inference engine in JAX, Flax and Pallas."""

from rosejax._xla_flags import set_default_xla_flags

set_default_xla_flags()  # before anything starts jax's backend

from rosejax.engine.llm_engine import LLMEngine  # noqa: E402
from rosejax.engine.request import RequestOutput  # noqa: E402
from rosejax.llm import LLM  # noqa: E402
from rosejax.sampling import SamplingParams  # noqa: E402

__all__ = ["LLM", "LLMEngine", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
