"""The offline API people know from vLLM: `LLM(model=...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from rosejax.engine.data_parallel import make_engine
from rosejax.engine.request import RequestOutput
from rosejax.models.loader import sampling_defaults
from rosejax.sampling import SamplingParams
from rosejax.settings import EngineConfig
from rosejax.tokenizer import chat_prompt_ids

Prompt = str | Sequence[int] | dict  # a dict: vLLM's {"prompt": ...} or {"prompt_token_ids": ...}
Prompts = Prompt | Sequence[Prompt]


def _unwrapped(prompt):
    """vLLM's prompt dicts, {"prompt": text} or {"prompt_token_ids": ids}, as the text or ids."""
    if not isinstance(prompt, dict):
        return prompt
    if len(prompt) == 1 and next(iter(prompt)) in ("prompt", "prompt_token_ids"):
        return next(iter(prompt.values()))
    raise ValueError(f'a prompt dict has one key, "prompt" or "prompt_token_ids": {list(prompt)}')


class LLM:
    """The offline API: `LLM(model=...).generate(prompts, SamplingParams(...))`."""

    def __init__(self, model: str, **engine_args):
        """`engine_args`: the other fields of `EngineConfig` (max_batch_size, dtype, kernels,
        data_parallel_size, ...). With data_parallel_size N the prompts are spread over N
        replicas, each in an engine process of its own (`ProcessDataParallelEngine`: a script
        building one needs `if __name__ == "__main__":`, the processes being spawned), or with
        engine_process=False each on a thread of this process (`DataParallelEngine`).
        `generation_config` ("auto": the model's generation_config.json) gives the sampling of
        calls without SamplingParams (`get_default_sampling_params`)."""
        config = EngineConfig(model=model, **engine_args)
        self._default_params = SamplingParams(**sampling_defaults(model, config.generation_config))
        self.engine = make_engine(config)
        self._submitted = 0  # requests submitted so far: default ids are gen-N

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: SamplingParams with the model's generation config applied (temperature,
        top_k, top_p, min_p, repetition_penalty), what a call without SamplingParams uses."""
        return self._default_params

    def _submit(self, prompts: Prompts, sampling_params, request_ids=None) -> list[str]:
        if not isinstance(prompts, str | Sequence | dict):
            raise ValueError(f"prompts: a prompt or a list of them, got {type(prompts).__name__}")
        if isinstance(prompts, str | dict) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = [_unwrapped(p) for p in prompts]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or self.get_default_sampling_params()] * len(prompts)
        if not isinstance(sampling_params, Sequence) or not all(
            isinstance(p, SamplingParams) for p in sampling_params
        ):
            raise ValueError("sampling_params: a SamplingParams, or a list of them")
        if len(sampling_params) != len(prompts):
            raise ValueError("give one SamplingParams, or one per prompt")
        base = self._submitted
        ids = list(request_ids or (f"gen-{base + i}" for i in range(len(prompts))))
        if len(ids) != len(prompts):
            raise ValueError("give one request id per prompt")
        added = []
        try:
            for rid, prompt, params in zip(ids, prompts, sampling_params, strict=True):
                self.engine.add_request(rid, prompt, params)
                added.append(rid)
        except ValueError:
            for rid in added:  # all or nothing: a bad prompt leaves nothing queued
                self.engine.abort_request(rid)
            raise
        self._submitted += len(ids)
        return ids

    def generate(
        self,
        prompts: Prompts,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt; one finished output per prompt, in order."""
        ids = self._submit(prompts, sampling_params)
        final: dict[str, RequestOutput] = {}
        progress = None
        if use_tqdm and len(ids) > 1:
            from tqdm.auto import tqdm

            progress = tqdm(total=len(ids), desc="requests", unit="req")
        for output in self._run(ids):
            if output.finished:
                final[output.request_id] = output
                if progress is not None:
                    progress.update(1)
        if progress is not None:
            progress.close()
        return [final[i] for i in ids]

    def chat(
        self,
        messages: Sequence[dict] | Sequence[Sequence[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """vLLM's `LLM.chat`: one conversation (a list of {"role", "content"} messages) or a
        list of them, each rendered by the tokenizer's chat template (or `chat_template`) and
        generated from; one finished output per conversation. `chat_template_kwargs` go to the
        template (Qwen3: {"enable_thinking": False})."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            chat_prompt_ids(
                self.engine.tokenizer,
                conversation,
                add_generation_prompt=add_generation_prompt,
                chat_template=chat_template,
                chat_template_kwargs=chat_template_kwargs,
            )
            for conversation in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def generate_stream(
        self,
        prompts: Prompts,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        request_ids: Sequence[str] | None = None,
    ) -> Iterator[RequestOutput]:
        """Yield each request's new text and token ids as they are produced; the requests of
        several prompts run together, so their outputs interleave: `request_ids` (one per
        prompt, default gen-N) tell them apart."""
        yield from self._run(self._submit(prompts, sampling_params, request_ids))

    def _run(self, ids: list[str]) -> Iterator[RequestOutput]:
        pending = set(ids)
        try:
            while pending:
                for output in self.engine.step():
                    if output.request_id in pending:
                        if output.finished:
                            pending.discard(output.request_id)
                        yield output
        finally:  # a consumer that stops early must not leave requests holding blocks
            for rid in pending:
                self.engine.abort_request(rid)
