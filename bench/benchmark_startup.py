"""How long `python -m rosejax.serve` takes to serve: launch to `/health` 200, over several starts,
with the phases read off the server's log as its lines arrive (each line timed on arrival).

    # CPU: random GPT-2, a persistent compilation cache that the untimed first start fills
    JAX_PLATFORMS=cpu python -m bench.benchmark_startup --runs 5 -- --model random:gpt2 \\
        --max-batch-size 256 --compilation-cache-dir /tmp/rosejax-startup-cache
    # before/after: two checkouts' starts alternated (A B A B ...), each with its own cache
    python -m bench.benchmark_startup --checkout ../main --checkout . --runs 5 -- --model ...

Phases (seconds after launch, median over the timed starts): `listening` (uvicorn runs: the
imports, the flags, the socket), `loading` (the engine starts loading: jax's backend is up),
`loaded` (the weights are made or dispatched, the tokenizer loaded), `kv_cache` (the cache is
sized; then it and the slot state are made), `compiled_N` (the Nth program compiled before
serving, on a GPU), `health_200`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

# Log line -> phase name; a phase is the first line that matches it (an engine process's lines
# name it: "rosejax [engine 0]: ...").
ENGINE = r"rosejax(?: \[engine \d+\])?: "
PHASES = (
    ("listening", re.compile(r"Uvicorn running on")),
    ("loading", re.compile(ENGINE + "loading ")),
    ("loaded", re.compile(ENGINE + "loaded the model and tokenizer")),
    ("kv_cache", re.compile(ENGINE + "KV cache: ")),
)
COMPILED = re.compile(ENGINE + r"compiled \w[\w-]* program ")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def health_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=1) as r:
            return r.status == 200
    except (OSError, urllib.error.HTTPError):
        return False


def one_start(checkout: str, server_args: list[str], timeout: float) -> dict[str, float]:
    """Launch the server from `checkout`, wait for /health 200, stop it; each phase's seconds
    after launch."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "rosejax.serve", *server_args, "--port", str(port)]
    cmd += ["--no-access-log"]
    env = {**os.environ, "PYTHONPATH": os.path.abspath(checkout)}
    lines: list[tuple[float, str]] = []
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd, cwd=checkout, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True
    )

    def read() -> None:
        for line in proc.stderr:
            lines.append((time.perf_counter() - t0, line.rstrip()))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        while not health_ok(url):
            if proc.poll() is not None or time.perf_counter() - t0 > timeout:
                tail = "\n".join(line for _, line in lines[-30:])
                raise SystemExit(f"the server did not serve (exit {proc.poll()}):\n{tail}")
            time.sleep(0.01)
        phases = {"health_200": time.perf_counter() - t0}
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        reader.join(10)
    compiled = 0
    for t, line in lines:
        for name, pattern in PHASES:
            if name not in phases and pattern.search(line) and t <= phases["health_200"]:
                phases[name] = t
        if COMPILED.search(line) and t <= phases["health_200"]:
            compiled += 1
            phases[f"compiled_{compiled}"] = t
    return phases


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Everything after -- goes to python -m rosejax.serve (--port is chosen here).",
    )
    p.add_argument(
        "--checkout",
        action="append",
        default=None,
        help="a checkout to start the server from (repeatable: their starts alternate); "
        "default: this one",
    )
    p.add_argument("--runs", type=int, default=5, help="timed starts per checkout; default 5")
    p.add_argument(
        "--untimed-runs",
        type=int,
        default=1,
        help="starts per checkout before the timed ones, not counted (they fill the "
        "compilation cache and the OS's file cache); default 1",
    )
    p.add_argument(
        "--timeout", type=float, default=600, help="seconds a start may take; default 600"
    )
    p.add_argument("--json", default=None, help="write every start's phases here")
    p.add_argument("server_args", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    server_args = args.server_args[1:] if args.server_args[:1] == ["--"] else args.server_args
    checkouts = args.checkout or [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
    runs: dict[str, list[dict[str, float]]] = {c: [] for c in checkouts}
    for i in range(args.untimed_runs + args.runs):
        for checkout in checkouts:
            phases = one_start(checkout, server_args, args.timeout)
            timed = i >= args.untimed_runs
            print(
                f"{checkout} {'start' if timed else 'untimed start'} {i + 1}: "
                + ", ".join(f"{k} {v:.2f}" for k, v in sorted(phases.items(), key=lambda x: x[1])),
                file=sys.stderr,
                flush=True,
            )
            if timed:
                runs[checkout].append(phases)
    names = [n for n, _ in PHASES]
    names += sorted({k for r in runs.values() for s in r for k in s if k.startswith("compiled_")})
    names.append("health_200")
    print(
        "phase (s after launch, median [min, max])".ljust(28)
        + "".join(f"{c:>28}" for c in checkouts)
    )
    for name in names:
        row = name.ljust(28)
        for checkout in checkouts:
            values = [s[name] for s in runs[checkout] if name in s]
            cell = (
                f"{statistics.median(values):.2f} [{min(values):.2f}, {max(values):.2f}]"
                if values
                else "-"
            )
            row += f"{cell:>28}"
        print(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"server_args": server_args, "runs": runs}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
