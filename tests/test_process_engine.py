"""Offline data parallelism with each replica in an engine process of its own
(`ProcessDataParallelEngine`, what `LLM(..., data_parallel_size=2)` builds), its two children on
two host devices, against one engine in this process (fp32, random weights): the same outputs
(greedy, seeded sampled, n > 1 with logprobs, prompt logprobs, a stop string; prompts of
different lengths, texts and ids), both replicas used, a prompt routed to the replica holding its
prefix, aborts, bad input refused with nothing queued, a child killed mid-run failing only its
own requests, and every child stopped once the engine is garbage collected. Behind
`@pytest.mark.slow`: no child outlives `close()`, the interpreter's exit or a killed parent.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from types import SimpleNamespace

import pytest

from rosejax import LLM, SamplingParams
from tests.data_parallel_checks import BLOCK, MODEL, engine_args

SEED = int(os.environ.get("ROSEJAX_TEST_SEED", random.randrange(2**31)))
ENGINE = engine_args(SEED)
WORDS = "the a of cat dog runs quickly over lazy river mountain blue green light time".split()
TWO_DEVICES = "--xla_force_host_platform_device_count=2"
# The module's engines (two child processes and one in-process) built once, on one xdist worker.
pytestmark = pytest.mark.xdist_group("process_engine")


def ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(50000) for _ in range(n)]


@pytest.fixture(scope="module")
def llms():
    """`one`: an `LLM` of one engine here; `dp`: an `LLM` of 2 replicas in engine processes,
    each on its own host device. At the end `dp` is dropped: its children must stop."""
    one = LLM(MODEL, **ENGINE)
    with pytest.MonkeyPatch.context() as env:  # the children's jax: 2 host devices
        env.setenv("XLA_FLAGS", f"{os.environ.get('XLA_FLAGS', '')} {TWO_DEVICES}")
        dp = LLM(MODEL, data_parallel_size=2, **ENGINE)
    processes = [r.child.process for r in dp.engine.replicas]
    stop = dp.engine._finalizer  # what its garbage collection calls
    held = SimpleNamespace(one=one, dp=dp)
    del dp
    yield held
    del held.dp
    gc.collect()
    if stop.alive:  # still referenced (a failed test's traceback): stop them anyway
        stop()
        pytest.fail("the engine outlived its LLM")
    for p in processes:
        p.join(15)
    assert [p.is_alive() for p in processes] == [False, False]
    assert not set(multiprocessing.active_children()) & set(processes)


def assert_logprobs_close(got, want) -> None:
    """Equal logprob lists (per position: None, or {token id: Logprob}): the same tokens, ranks
    and texts, values within 1e-4 (a replica's batch holds other rows, so its programs' shapes
    and their float sums' order differ)."""
    assert (got is None) == (want is None)
    for g, w in zip(got or [], want or [], strict=True):
        assert (g is None) == (w is None)
        assert {t: (x.rank, x.decoded_token) for t, x in (g or {}).items()} == {
            t: (x.rank, x.decoded_token) for t, x in (w or {}).items()
        }
        for t in g or {}:
            assert g[t].logprob == pytest.approx(w[t].logprob, abs=1e-4)


def assert_same_outputs(got: list, want: list) -> None:
    """Finished outputs alike: ids, tokens, texts and finish reasons equal, logprobs close."""
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert (g.request_id, g.prompt_token_ids, g.finish_reason) == (
            w.request_id,
            w.prompt_token_ids,
            w.finish_reason,
        ), f"seed {SEED}"
        assert_logprobs_close(g.prompt_logprobs, w.prompt_logprobs)
        for c, d in zip(g.outputs, w.outputs, strict=True):
            assert (c.index, c.token_ids, c.text, c.finish_reason) == (
                d.index,
                d.token_ids,
                d.text,
                d.finish_reason,
            ), f"seed {SEED}"
            assert_logprobs_close(c.logprobs, d.logprobs)
            if d.cumulative_logprob is not None:
                assert c.cumulative_logprob == pytest.approx(d.cumulative_logprob, abs=1e-3)


def run_both(llms, prompts, params, tag: str) -> tuple[list, list]:
    """Each `LLM`'s finished outputs of the same requests (ids tag-i), streamed; checks that
    the router sent them to both replicas."""
    rids = [f"{tag}-{i}" for i in range(len(prompts))]
    final = {}
    router = llms.dp.engine.router
    route, routed = router.route, []
    # Each request's replica as it is routed (one replica may finish all of its requests before
    # the stream's first output, so asking the engine then can miss it).
    router.route = lambda *a: routed.append(route(*a)) or routed[-1]
    try:
        for out in llms.dp.generate_stream(prompts, params, request_ids=rids):
            if out.finished:
                final[out.request_id] = out
    finally:
        del router.route
    assert set(routed) == {0, 1}
    want = [o for o in llms.one.generate_stream(prompts, params, request_ids=rids) if o.finished]
    return [final[r] for r in rids], sorted(want, key=lambda o: rids.index(o.request_id))


@pytest.mark.slow  # in `.ci/run`'s second pytest call: keeps `pytest -q` short
def test_outputs_equal_one_engines(llms):
    rng = random.Random(SEED)
    engine = llms.dp.engine
    # On both replicas at once (a server's first programs: the smallest prefill first).
    engine.compile_ahead(*engine.warmup_programs()[:1])
    assert [r.num_compiles for r in engine.replicas] == [1, 1]
    # Prompts of 1 to 8 tokens: one prefill length bucket, few programs to compile.
    prompts = [" ".join(rng.choices(WORDS, k=rng.randint(1, 4))) for _ in range(3)]
    prompts += [ids(rng, rng.randint(1, 8)) for _ in range(3)]
    params = [SamplingParams(max_tokens=rng.randint(3, 12), temperature=0) for _ in prompts]
    seed = rng.randrange(2**31)
    params[1] = SamplingParams(max_tokens=7, temperature=0.9, top_k=20, n=2, logprobs=2, seed=seed)
    params[4] = SamplingParams(max_tokens=5, temperature=0, prompt_logprobs=1)
    got, want = run_both(llms, prompts, params, "same")
    assert_same_outputs(got, want)
    assert engine.loads == [0, 0] and not engine.has_unfinished_requests()
    assert not any(r._rows._requests for r in engine.replicas)  # nothing kept of them
    assert all(r.host_seconds["dispatch"] > 0 for r in engine.replicas)


def test_prefix_goes_to_its_holder(llms):
    """A prompt whose two leading blocks replica 1 served goes there, though replica 0 is as
    idle, and reuses those blocks from its prefix cache."""
    rng = random.Random(SEED + 1)
    engine, greedy = llms.dp.engine, SamplingParams(max_tokens=3, temperature=0)
    shared = ids(rng, 2 * BLOCK)
    llms.dp.generate([ids(rng, 5), shared + [1, 2]], greedy, use_tqdm=False)  # 0, then 1
    hits = [r.snapshot["prefix_hit_tokens"] for r in engine.replicas]
    prompt = shared + ids(rng, 3)
    out = llms.dp.generate(prompt, greedy, use_tqdm=False)[0]
    assert [r.snapshot["prefix_hit_tokens"] for r in engine.replicas] == [
        hits[0],
        hits[1] + 2 * BLOCK,
    ]
    assert out.token_ids == llms.one.generate(prompt, greedy, use_tqdm=False)[0].token_ids


def idle(engine, deadline_s: float = 20.0) -> None:
    """Step until every child has said it holds no request and no KV block."""
    deadline = time.monotonic() + deadline_s
    while any(r.snapshot["running"] + r.snapshot["kv_blocks_used"] for r in engine.replicas):
        assert time.monotonic() < deadline, [r.snapshot for r in engine.replicas]
        assert engine.step() == []
        time.sleep(0.02)


def test_abort_and_bad_input_leave_nothing_queued(llms):
    rng = random.Random(SEED + 2)
    dp, engine = llms.dp, llms.dp.engine
    long = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
    for i in range(4):  # equal costs: two a replica
        engine.add_request(f"long-{i}", ids(rng, 4), long)
    assert sorted(engine.replica_of(f"long-{i}") for i in range(4)) == [0, 0, 1, 1]
    seen = []
    while not seen:
        seen = engine.step()
    assert any(r.snapshot["running"] for r in engine.replicas)
    for i in range(4):
        engine.abort_request(f"long-{i}")
    assert engine.loads == [0, 0] and not engine.has_unfinished_requests()
    idle(engine)  # the children freed them, and said nothing more of them

    good = ids(rng, 5)
    greedy = SamplingParams(max_tokens=6, temperature=0)
    cases = [
        ([good, [1, 2, 99999999]], greedy, "token ids"),  # not a token id
        ([good, [5] * 129], greedy, "context"),  # longer than tiny's 128-token context
        ([good, good], SamplingParams(stop_token_ids=[10**6]), "stop_token_ids"),
        (["the", good], SamplingParams(logit_bias={10**6: 1.0}), "logit_bias"),
    ]
    for prompts, params, match in cases:
        with pytest.raises(ValueError, match=match):
            dp.generate(prompts, params, use_tqdm=False)
        assert engine.loads == [0, 0] and not engine.has_unfinished_requests()
    engine.add_request("twice", good, greedy)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("twice", good, greedy)
    engine.abort_request("twice")
    idle(engine)
    out = dp.generate(good, greedy, use_tqdm=False)[0]
    assert out.token_ids == llms.one.generate(good, greedy, use_tqdm=False)[0].token_ids


def test_an_id_added_again_right_after_its_abort_gets_only_its_own_outputs(llms):
    """Rows the child sent for an aborted request before it read the abort must not reach a
    new request of the same id (they did: extra tokens, or the old output as the new one)."""
    rng = random.Random(SEED + 3)
    engine = llms.dp.engine
    long = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
    short = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    for _ in range(3):
        engine.add_request("again", ids(rng, 4), long)
        while not engine.step():  # running: its rows are on their way
            pass
        engine.abort_request("again")
        prompt = ids(rng, 6)
        engine.add_request("again", prompt, short)
        outs = []
        while engine.has_unfinished_requests():
            outs += engine.step()
        want = llms.one.generate(prompt, short, use_tqdm=False)[0]
        assert {o.request_id for o in outs} == {"again"} and outs[-1].finished
        assert outs[-1].token_ids == want.token_ids and outs[-1].metrics is not None
    idle(engine)


# Last of the module: it kills one of the module engine's children.
def test_killed_child_fails_only_its_requests(llms):
    rng = random.Random(SEED + 3)
    engine = llms.dp.engine
    long = SamplingParams(max_tokens=120, temperature=0, ignore_eos=True)
    rids = [f"kill-{i}" for i in range(4)]
    for rid in rids:
        engine.add_request(rid, ids(rng, 4), long)
    on = {rid: engine.replica_of(rid) for rid in rids}
    final, started = {}, set()

    def step() -> None:
        for out in engine.step():
            started.add(out.request_id)
            if out.finished:
                final[out.request_id] = out

    while not {rid for rid in rids if on[rid] == 1} <= started:  # the victim's have begun
        step()
    victim = engine.replicas[1].child.process
    os.kill(victim.pid, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline
        step()
    for rid in rids:
        out = final[rid]
        if on[rid] == 1:
            assert out.finish_reason == "error" and "SIGKILL" in out.error, out
        else:
            assert out.finish_reason == "length" and len(out.token_ids) == 120, out
    assert engine.loads == [0, 0] and victim.exitcode == -signal.SIGKILL
    with pytest.raises(RuntimeError, match="replica 1 died"):
        engine.replicas[1].add_request("late", [1, 2, 3])
    # New requests go to the replica that lives, whatever the loads and prefixes say.
    late = [f"late-{i}" for i in range(3)]
    for rid in late:
        engine.add_request(rid, ids(rng, 4), SamplingParams(max_tokens=4, temperature=0))
        assert engine.replica_of(rid) == 0
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline
        step()
    assert all(final[rid].finish_reason == "length" for rid in late)


EXIT_SCRIPT = """
import os, sys
from rosejax import LLM

if __name__ == "__main__":
    args = dict(warmup=False, max_batch_size=2, kv_cache_tokens=512, dtype="float32")
    llm = LLM("random:tiny", data_parallel_size=2, **args)
    with llm.engine as engine:
        print(*(r.child.pid for r in engine.replicas), flush=True)
    print(*(r.child.process.exitcode for r in engine.replicas), flush=True)
    llm = LLM("random:tiny", data_parallel_size=2, **args)
    llm.generate([1, 2, 3], use_tqdm=False)
    print(*(r.child.pid for r in llm.engine.replicas), flush=True)
    if sys.argv[1] == "kill":
        os.kill(os.getpid(), 9)
"""


def _gone(pids: list[int], within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while any(os.path.exists(f"/proc/{pid}") for pid in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


@pytest.mark.slow  # two interpreters, each spawning four engine processes
@pytest.mark.parametrize("end", ["exit", "kill"])
def test_no_child_outlives_close_exit_or_a_killed_parent(tmp_path, end):
    """`close()` (a `with` block) stops the children at once (each exits 0); an interpreter
    that exits without closing stops them, and one killed leaves them to see their pipe close
    and exit."""
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(EXIT_SCRIPT))
    env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {TWO_DEVICES}"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root
    proc = subprocess.run(
        [sys.executable, str(script), end], capture_output=True, text=True, env=env, timeout=300
    )
    lines = proc.stdout.split("\n")
    assert proc.returncode == (-9 if end == "kill" else 0), proc.stderr[-3000:]
    closed, codes, left = (line.split() for line in lines[:3])
    assert codes == ["0", "0"], proc.stderr[-3000:]
    assert _gone([int(p) for p in closed], 0)
    assert _gone([int(p) for p in left], 20), proc.stderr[-3000:]
