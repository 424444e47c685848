"""Tensor parallelism on four host devices: TP=2 and TP=4 give TP=1's tokens (float32), which are
HF transformers' greedy tokens, for GPT-2 and a Qwen3 model with grouped-query attention, on the
XLA path and with the Pallas kernels interpreted under shard_map; bad configurations fail at
start naming the flag; two processes joined by `jax.distributed` generate what one does.

The test process started jax with one CPU device (conftest), so the engines run in a subprocess
whose XLA_FLAGS ask for four (tests/tensor_parallel_worker.py), several engines per subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from bench.serving.launch import free_port
from rosejax import LLM
from rosejax.settings import EngineConfig
from tests.conftest import hf_greedy, make_hf_checkpoint
from tests.test_llama_family import make_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 997  # padded to 1,024 rows: 512 or 256 a shard
# Grouped queries (8 heads over 4 KV heads: at TP=4 one KV head and its two query heads a shard),
# q/k/v/o biases, an untied LM head (column-parallel) beside the row-parallel embedding.
QWEN3 = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=16,
    max_position_embeddings=64,
    attention_bias=True,
    tie_word_embeddings=False,
)
GPT2 = dict(vocab_size=VOCAB, n_positions=64, n_embd=64, n_layer=2, n_head=4)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    """name -> (checkpoint dir, HF torch model)."""
    gpt2 = tmp_path_factory.mktemp("tp-gpt2")
    qwen3 = tmp_path_factory.mktemp("tp-qwen3")
    small = tmp_path_factory.mktemp("tp-qwen3-2kv")
    two_kv = QWEN3 | dict(num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
    return {
        "gpt2": (str(gpt2), make_hf_checkpoint(gpt2, seed=3, **GPT2)),
        "qwen3": (str(qwen3), make_checkpoint(qwen3, "qwen3", seed=4, **QWEN3)),
        "qwen3-2kv": (str(small), make_checkpoint(small, "qwen3", seed=5, **two_kv)),
    }


def run_worker(tmp_path, models: dict, prompts, cases: list[str], full: bool = False) -> dict:
    spec = dict(
        models={name: path for name, (path, _) in models.items()},
        prompts=prompts,
        full=full,
        cases=cases,
        out=str(tmp_path / "results.json"),
    )
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    env = os.environ | {
        "XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4",
        "JAX_PLATFORMS": "cpu",
    }
    proc = subprocess.run(
        [sys.executable, "-m", "tests.tensor_parallel_worker", str(tmp_path / "spec.json")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["devices"] == 4
    return data["results"]


def random_prompts() -> list[list[int]]:
    rng = np.random.default_rng(1)
    return [rng.integers(0, VOCAB, n).tolist() for n in (1, 6, 19, 11)]


def assert_hf_greedy(hf, prompts, tokens) -> None:
    assert isinstance(tokens, list), tokens  # the worker's error message otherwise
    assert len({t for row in tokens for t in row}) > 5, "random weights too flat to test"
    for prompt, row in zip(prompts, tokens, strict=True):
        assert row == hf_greedy(hf, prompt, len(row))


@pytest.mark.slow  # in `.ci/run`'s second pytest call: keeps `pytest -q` short
def test_tensor_parallel_gives_hf_tokens_and_bad_sizes_are_named(tmp_path, models):
    """GPT-2 at TP=2 and the grouped-query Qwen3 at TP=4 (XLA path; the engine at TP=1 is
    checked against the same HF references in test_engine and test_llama_family)."""
    prompts = random_prompts()
    cases = ["gpt2:2:xla", "qwen3:4:xla", "gpt2:8:error", "gpt2:3:error", "qwen3-2kv:4:error"]
    results = run_worker(tmp_path, models, prompts, cases)
    assert_hf_greedy(models["gpt2"][1], prompts, results["gpt2:2:xla"])
    assert_hf_greedy(models["qwen3"][1], prompts, results["qwen3:4:xla"])
    assert results["gpt2:8:error"].startswith("--tensor-parallel-size 8 needs 8 devices; 4")
    assert (
        "--tensor-parallel-size 3 does not divide the model's 4 attention heads"
        in (results["gpt2:3:error"])
    )
    assert (
        "--tensor-parallel-size 4 does not divide the model's 2 KV heads"
        in (results["qwen3-2kv:4:error"])
    )


@pytest.mark.slow
def test_tensor_parallel_every_size_and_the_kernels(tmp_path, models):
    """Both families at TP 1, 2 and 4 on the XLA path, at TP 2 with every Pallas kernel
    interpreted (the fused decode attention + append, paged prefill attention, norms, the small
    matmul) and as 2 data-parallel replicas of TP 2, then a seeded sampled request beside
    prefix-cache hits: the same tokens everywhere."""
    prompts = random_prompts()
    sizes = ["1:xla", "2:xla", "4:xla", "2:kernels", "2:xla:2"]  # the last: 2 replicas of TP=2
    cases = [f"{m}:{size}" for m in ("gpt2", "qwen3") for size in sizes]
    results = run_worker(tmp_path, models, prompts, cases, full=True)
    for m in ("gpt2", "qwen3"):
        reference = results[f"{m}:1:xla"]
        assert_hf_greedy(models[m][1], prompts, reference[: len(prompts)])
        for case in cases:
            if case.startswith(m + ":"):
                assert results[case] == reference, case


def test_config_and_flags_checked():
    with pytest.raises(ValueError, match="--tensor-parallel-size must be >= 1"):
        EngineConfig(model="random:tiny", tensor_parallel_size=0)
    with pytest.raises(ValueError, match="--process-id must be in"):
        EngineConfig(model="random:tiny", num_processes=2, process_id=2)
    with pytest.raises(ValueError, match="needs --distributed-coordinator-address"):
        EngineConfig(model="random:tiny", num_processes=2, process_id=1)
    with pytest.raises(ValueError, match="must be HOST:PORT"):
        EngineConfig(model="random:tiny", distributed_coordinator_address="localhost")
    with pytest.raises(ValueError, match="--tensor-parallel-size 2 needs 2 devices; 1 cpu"):
        LLM("random:tiny", tensor_parallel_size=2)


@pytest.mark.slow
def test_two_processes_generate_what_one_does():
    """`python -m rosejax.generate` as two processes of one CPU device each (jax.distributed,
    gloo collectives), TP=2 across them: process 0 prints one process's TP=1 text, process 1
    nothing."""
    flags = ["--model", "random:tiny-qwen3", "--prompt", "Hello, my name is", "--prompt", "The"]
    flags += ["--max-new-tokens", "12", "--ignore-eos", "--no-warmup", "--dtype", "float32"]
    env = os.environ | {"JAX_PLATFORMS": "cpu"}

    def launch(*extra: str) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "rosejax.generate", *flags, *extra],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    address = f"127.0.0.1:{free_port()}"
    pair = [
        launch(
            "--tensor-parallel-size",
            "2",
            "--distributed-coordinator-address",
            address,
            "--num-processes",
            "2",
            "--process-id",
            str(i),
        )
        for i in (0, 1)
    ]
    outs = [p.communicate(timeout=300) for p in pair]
    for p, (_, err) in zip(pair, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
    single, _ = launch().communicate(timeout=300)
    assert "tensor parallel over 2 devices" in outs[0][1]
    assert _without_gloo(outs[0][0]) == single and "[finish: length]" in single
    assert _without_gloo(outs[1][0]) == ""


def _without_gloo(stdout: str) -> str:
    """Without the line gloo prints on connecting (C++, to stdout)."""
    return "".join(line for line in stdout.splitlines(True) if not line.startswith("[Gloo]"))
