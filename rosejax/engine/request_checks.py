"""What the engine refuses of a request before it queues it (ValueError), in functions an API
process runs too: the prompt's ids, checked against the model's context and vocabulary, and the
request's settings against the vocabulary and the KV cache."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from rosejax.engine.request import max_output, request_stop_ids
from rosejax.model_runner import MAX_MIN_TOKENS_STOP_IDS
from rosejax.models import eos_token_ids
from rosejax.sampling import SamplingParams


def prompt_too_long(prompt_len: int, context: int) -> str:
    """vLLM's words for a prompt that leaves no room in the context (clients parse them)."""
    return (
        f"This model's maximum context length is {context} tokens. However, your request has "
        f"{prompt_len} input tokens. Please reduce the length of the input messages."
    )


def checked_prompt_ids(prompt: str | Sequence[int], tokenizer: Any, config: Any) -> list[int]:
    """The prompt's token ids (`tokenizer` encodes a text), checked: not empty, within the
    model's (`config`) context and vocabulary (ValueError)."""
    n_pos, vocab = config.max_model_len, config.vocab_size
    if isinstance(prompt, str):
        try:
            ids = tokenizer.encode(prompt)
        except Exception as e:  # e.g. a lone surrogate, which no encoding holds
            raise ValueError(f"the prompt's text cannot be tokenized: {e}") from e
    elif not isinstance(prompt, Sequence | np.ndarray):
        raise ValueError(f"a prompt is a str or a list of token ids, got {type(prompt).__name__}")
    elif len(prompt) > n_pos:  # the length first: a hostile list is neither read nor copied
        ids = prompt
    else:
        if not all(isinstance(t, int | np.integer) and not isinstance(t, bool) for t in prompt):
            raise ValueError("prompt token ids must be ints")
        ids = list(map(int, prompt))
    if not ids:
        raise ValueError("prompt is empty")
    if len(ids) > n_pos:
        raise ValueError(prompt_too_long(len(ids), n_pos))
    if min(ids) < 0 or max(ids) >= vocab:
        raise ValueError(f"prompt token ids must be in [0, {vocab})")
    return ids


def check_request(
    ids: Sequence[int], params: SamplingParams, config: Any, kv_blocks: int, block_size: int
) -> None:
    """What `add_request` refuses of a request with checked prompt ids (ValueError): stop token
    ids or logit_bias ids outside the vocabulary, more stop ids than min_tokens can hold off,
    more tokens than a KV cache of `kv_blocks` blocks holds. A server with engine processes
    checks it before a request leaves the API process."""
    vocab = config.vocab_size
    for name in ("stop_token_ids", "logit_bias"):
        values = getattr(params, name) or ()
        if values and not (min(values) >= 0 and max(values) < vocab):
            raise ValueError(f"{name} must hold token ids in [0, {vocab})")
    stop_ids = request_stop_ids(params, eos_token_ids(config))
    if params.min_tokens and len(stop_ids) > MAX_MIN_TOKENS_STOP_IDS:
        raise ValueError(
            f"min_tokens holds off at most {MAX_MIN_TOKENS_STOP_IDS} stop ids (EOS included), "
            f"this request has {len(stop_ids)}"
        )
    need = -(
        -(len(ids) + max_output(len(ids), params.max_tokens, config.max_model_len)) // block_size
    )
    if need > kv_blocks:
        raise ValueError(
            f"the KV cache ({kv_blocks} blocks of {block_size}) cannot hold this request "
            f"({need} blocks); raise kv_cache_tokens"
        )
