"""lm-evaluation-harness scores the same through the server as on HF transformers (issue 20).

Its `local-completions` backend against a rosejax server, and its `hf` backend (torch, fp32,
CPU), on one random-weight GPT-2 checkpoint written by `save_pretrained` (with the GPT-2
tokenizer), run the three tasks of tests/lm_eval_tasks (local data): per document the same
loglikelihoods (within 1e-3), greedy flags, generations and metrics. local-completions finds
the server's tokenizer endpoints (/tokenizer_info, /tokenize) and sends token-id prompts: a
loglikelihood request is `echo` + `logprobs: 1` + `max_tokens: 1` on the context and
continuation; generate_until is greedy with `stop`.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import pytest

from rosejax import LLMEngine
from rosejax.serve import create_app
from rosejax.serve.server import ServerThread
from rosejax.tokenizer import packaged_gpt2_tokenizer_path
from tests.conftest import make_hf_checkpoint

pytestmark = pytest.mark.slow  # two lm-eval runs, one of them on a compiling engine: ~40 s
lm_eval = pytest.importorskip(
    "lm_eval", reason="lm-evaluation-harness is not installed (pip install -e '.[test]')"
)
requests = pytest.importorskip("requests")  # lm-eval's HTTP client

ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "tests" / "lm_eval_tasks"
SEED = int(os.environ.get("ROSEJAX_TEST_SEED", random.randrange(2**31)))
CONTEXT = 128  # every document fits one window, so both backends score the same tokens


@pytest.fixture(scope="module")
def lm_eval_env(tmp_path_factory):
    """No hub, a fresh datasets cache, and the repository root as the working directory (the
    task files name their data relative to it)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("HF_DATASETS_OFFLINE", "1")
        mp.setenv("HF_DATASETS_CACHE", str(tmp_path_factory.mktemp("datasets")))
        mp.chdir(ROOT)
        yield


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("lm-eval-gpt2")
    make_hf_checkpoint(
        path, seed=SEED, vocab_size=50257, n_positions=CONTEXT, n_embd=32, n_layer=2, n_head=2
    )
    # GPT-2's tokenizer files, the copy rosejax carries, next to the weights
    for f in Path(packaged_gpt2_tokenizer_path()).iterdir():
        if f.is_file():
            shutil.copy(f, path)
    return str(path)


def evaluate(model: str, model_args: str, tasks: list[str]) -> dict:
    """{task: (its metrics, {doc_id: its logged sample})}."""
    from lm_eval.tasks import TaskManager

    out = lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=tasks,
        task_manager=TaskManager(include_path=str(TASKS)),
        batch_size=1,
        log_samples=True,
        random_seed=SEED % 2**31,
    )
    return {
        task: (out["results"][task], {s["doc_id"]: s for s in out["samples"][task]})
        for task in tasks
    }


@pytest.fixture(scope="module")
def hf_scores(lm_eval_env, checkpoint) -> dict:
    args = f"pretrained={checkpoint},dtype=float32,device=cpu"
    return evaluate("hf", args, ["rosejax_mc", "rosejax_ppl", "rosejax_gen"])


@pytest.fixture(scope="module")
def server_url(lm_eval_env, checkpoint):
    engine = LLMEngine.from_args(
        checkpoint, dtype="float32", warmup=False, max_batch_size=4, block_size=16, seed=SEED
    )
    with ServerThread(create_app(engine, served_model_name="gpt2-random")) as server:
        yield server.url


def test_lm_eval_finds_the_servers_tokenizer(server_url):
    from lm_eval.utils import check_remote_tokenizer_support

    assert check_remote_tokenizer_support(server_url + "/v1/completions")


@pytest.mark.parametrize(
    "task",
    ["rosejax_mc", "rosejax_ppl", "rosejax_gen"],
)
def test_local_completions_scores_equal_hf(task, hf_scores, server_url):
    args = (
        f"base_url={server_url}/v1/completions,model=gpt2-random,max_length={CONTEXT},"
        "max_retries=1"  # an error is final: no waits between retries
    )
    metrics, samples = evaluate("local-completions", args, [task])[task]
    hf_metrics, hf_samples = hf_scores[task]
    assert samples.keys() == hf_samples.keys()
    where = f"{task}, seed {SEED}"
    for doc_id, sample in samples.items():
        got, want = sample["filtered_resps"], hf_samples[doc_id]["filtered_resps"]
        if task == "rosejax_gen":
            assert got == want, where
        elif task == "rosejax_ppl":  # one summed loglikelihood per document
            assert got == pytest.approx(want, abs=1e-3), where
        else:  # (loglikelihood, is_greedy) per choice
            assert [x[0] for x in got] == pytest.approx([x[0] for x in want], abs=1e-3), where
            assert [x[1] for x in got] == [x[1] for x in want], where
    for name, value in hf_metrics.items():
        if name.endswith(",none") and "stderr" not in name:
            if "acc" in name or "exact_match" in name:
                assert metrics[name] == value, (name, where)
            else:  # perplexities: from the loglikelihoods checked above
                assert metrics[name] == pytest.approx(value, rel=1e-3), (name, where)


@pytest.mark.parametrize("greedy", [True, False])
def test_lm_eval_reads_the_echoed_logprobs_body(greedy):
    """What lm-eval makes of the server's answer to its loglikelihood request (echo, logprobs
    1, max_tokens 1), from hand-made logprobs: the continuation's summed logprob, and whether
    each of its tokens was the most likely."""
    import numpy as np
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    from rosejax.serve.responses import Formatter
    from tests.test_server_fields import VOCAB, decode, hand_output, steps_for

    np_rng = np.random.default_rng(SEED)
    context, continuation = 3, 4
    full = [int(x) for x in np_rng.integers(0, VOCAB - 2, size=context + continuation + 1)]
    prompt, generated = full[:-1], full[-1:]
    logits = np_rng.normal(size=(len(full), VOCAB))
    for t in range(context, context + continuation):  # each continuation token the likeliest
        logits[t, full[t]] = 50
    if not greedy:  # but one
        logits[context + 1, full[context + 1]] = -50
    steps, lsm, _ = steps_for(logits, full, 1)
    out = hand_output(prompt, [None, *steps[1 : len(prompt)]], generated, steps[len(prompt) :])
    echo = ["".join(decode(i) for i in prompt)]
    body = Formatter("cmpl-x", "m", chat=False, logprobs=1, decode=decode, echo=echo).response(
        [out]
    )
    [(loglikelihood, is_greedy)] = LocalCompletionsAPI.parse_logprobs(body, ctxlens=[context])
    want = sum(lsm[t, full[t]] for t in range(context, context + continuation))
    assert loglikelihood == pytest.approx(want, abs=1e-9)
    assert is_greedy == greedy
