"""vLLM's --generation-config: a checkpoint's generation_config.json (written by transformers'
`GenerationConfig.save_pretrained`) gives the sampling of requests that leave it out, in
`LLM` and in the server (its API server processes included); "vllm" and a directory choose."""

from __future__ import annotations

import random
import signal

import httpx
import pytest
from transformers import GenerationConfig

from rosejax import LLM, SamplingParams
from rosejax.models.loader import sampling_defaults
from rosejax.serve.cli import main
from rosejax.tokenizer import packaged_gpt2_tokenizer_path
from tests.conftest import HF_SHAPES, make_hf_checkpoint
from tests.test_server import start_cli, stop_cli

rng = random.Random()


def random_sampling() -> dict:
    return dict(
        temperature=round(rng.uniform(0.1, 2.0), 3),
        top_k=rng.randint(1, 100),
        top_p=round(rng.uniform(0.1, 0.99), 3),
        min_p=round(rng.uniform(0.01, 0.5), 3),
        repetition_penalty=round(rng.uniform(0.5, 2.0), 3),
    )


def test_sampling_defaults_read_the_generation_config(tmp_path):
    fields = random_sampling()
    GenerationConfig(do_sample=True, eos_token_id=[1, 2], **fields).save_pretrained(tmp_path)
    assert sampling_defaults(str(tmp_path)) == fields
    assert sampling_defaults(str(tmp_path), "vllm") == {}
    assert sampling_defaults("random:tiny", str(tmp_path)) == fields  # a directory: its file
    assert sampling_defaults("random:tiny") == {}
    empty = tmp_path / "empty"
    empty.mkdir()
    assert sampling_defaults(str(empty)) == {}  # "auto": a model without one has none
    with pytest.raises(ValueError, match="generation-config"):
        sampling_defaults("random:tiny", str(empty))
    GenerationConfig(do_sample=True, top_p=1.5).save_pretrained(empty)
    with pytest.raises(ValueError, match="top_p"):
        sampling_defaults(str(empty))


def test_llm_without_sampling_params_uses_the_generation_config(tmp_path):
    """top_k=1 in the generation config: generate() without SamplingParams decodes greedily
    (at temperature 1.7, whose samples would part from greedy); "vllm" ignores the file."""
    make_hf_checkpoint(tmp_path, **HF_SHAPES["hd16"])
    fields = dict(temperature=1.7, top_k=1)
    GenerationConfig(do_sample=True, **fields).save_pretrained(tmp_path)
    engine = dict(warmup=False, max_batch_size=4, tokenizer=packaged_gpt2_tokenizer_path())
    llm = LLM(str(tmp_path), **engine)
    params = llm.get_default_sampling_params()
    assert (params.temperature, params.top_k) == (1.7, 1)
    prompts = [[rng.randrange(1000) for _ in range(rng.randint(2, 9))] for _ in range(3)]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, use_tqdm=False)]
    greedy = SamplingParams(temperature=0, max_tokens=params.max_tokens, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    assert got == want
    vllm = LLM(str(tmp_path), **engine, generation_config="vllm")
    assert vllm.get_default_sampling_params() == SamplingParams()


def test_server_refuses_a_generation_config_directory_without_one(tmp_path, capsys):
    assert main(["--model", "random:tiny", "--generation-config", str(tmp_path)]) == 2
    assert "generation_config.json" in capsys.readouterr().err


@pytest.mark.slow  # a server subprocess, its two API server processes and its engine process
def test_server_requests_take_the_generation_config(tmp_path):
    """Each API server process applies the defaults: a request without sampling fields decodes
    greedily under top_k=1 (and its other fields from the file), one that sends top_k does not."""
    GenerationConfig(do_sample=True, temperature=1.5, top_k=1).save_pretrained(tmp_path)
    proc, url, log = start_cli(
        tmp_path, "--generation-config", str(tmp_path), "--api-server-count", "2"
    )
    try:
        prompts = [
            " ".join(rng.choices(["a", "cat", "runs", "over", "the"], k=5)) for _ in range(6)
        ]

        def text(**fields) -> list[str]:
            body = {"prompt": prompts, "max_tokens": 12, "model": "tiny", **fields}
            r = httpx.post(url + "/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            return [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]

        greedy = text(temperature=0)
        for _ in range(3):  # new connections: either API server process may answer
            assert text() == greedy
        sampled = [text(top_k=0, seed=s) for s in range(3)]
        assert any(s != greedy for s in sampled)  # temperature 1.5 over the whole vocabulary
    finally:
        stop_cli(proc, log, signal.SIGINT)
