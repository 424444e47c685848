"""A `python -m rosejax.serve` launched for the run, up and every program compiled and run once
before the clock starts."""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

from bench import common
from bench.serving.flags import LOOPBACK
from bench.serving.http_client import http_get_json, metric_sums


def _unparse(value: Any) -> str:
    """A parsed value of an engine flag back as its text (--kernel, --kernel-tile items too)."""
    if isinstance(value, tuple):
        if len(value) == 2:
            return f"{value[0]}={value[1]}"
        return f"{value[0]}.{value[1]}={value[2]}"
    return str(value)


def server_argv(args: argparse.Namespace) -> list[str]:
    """The engine flags (and --seed) of `args` as `python -m rosejax.serve` arguments."""
    p = argparse.ArgumentParser(add_help=False)
    common.add_engine_args(p)
    out: list[str] = []
    for action in p._actions:
        value = getattr(args, action.dest, None)
        if value is None or value is False or value == []:
            continue
        flag = action.option_strings[0]
        if value is True:
            out.append(flag)
        elif isinstance(value, list):
            for item in value:
                out += [flag, _unparse(item)]
        else:
            out += [flag, _unparse(value)]
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def programs_to_compile(base_url: str) -> int:
    """The server's rosejax_programs_to_compile gauge (programs not compiled or not run once
    yet), summed over its replicas (0 if it has none or does not answer)."""
    name = "rosejax_programs_to_compile"
    return int((metric_sums(base_url, [name]) or {name: 0})[name])


class LaunchedServer:
    """`python -m rosejax.serve` in a subprocess on a free loopback port, up once /health is;
    or, given `floor_tpot_ms`, `bench.serving.floor_server` (no engine) streaming at that TPOT."""

    def __init__(
        self,
        args: argparse.Namespace,
        env: dict[str, str] | None = None,
        floor_tpot_ms: float | None = None,
    ):
        """`env`: variables set for the server beside this process's."""
        self.env = env or {}
        self.port = free_port()
        self.url = f"http://{LOOPBACK}:{self.port}"
        where = ["--host", LOOPBACK, "--port", str(self.port)]
        if floor_tpot_ms is not None:
            floor = ["bench.serving.floor_server", "--tpot-ms", str(floor_tpot_ms)]
            self.cmd = [sys.executable, "-m", *floor, *where]
        else:
            self.cmd = [
                sys.executable,
                "-m",
                "rosejax.serve",
                *server_argv(args),
                *(
                    ["--served-model-name", args.served_model_name]
                    if args.served_model_name
                    else []
                ),
                *where,
                "--log-level",
                "warning",
                "--no-access-log",
                *shlex.split(args.server_args),
            ]
        self.timeout = args.launch_timeout
        if args.server_log:
            self.log_path = args.server_log
        else:
            fd, self.log_path = tempfile.mkstemp(prefix="rosejax-serve-", suffix=".log")
            os.close(fd)
        self.proc: subprocess.Popen | None = None
        self.start_seconds: float | None = None
        self.wait_compiled = not args.no_wait_compiled
        self.compiled_seconds: float | None = None

    def log_tail(self, n: int = 40) -> str:
        with open(self.log_path, errors="replace") as f:
            return "".join(f.readlines()[-n:])

    def __enter__(self) -> LaunchedServer:
        print(f"launching: {shlex.join(self.cmd)} (log {self.log_path})", file=sys.stderr)
        env = common.child_env(self.env)
        t0 = time.perf_counter()
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                self.cmd, stdout=log, stderr=subprocess.STDOUT, cwd=common.REPO, env=env
            )
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                if http_get_json(self.url + "/health", timeout=2).get("status") == "ok":
                    break
            except (OSError, ValueError):
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise SystemExit(
                    f"the server did not come up in {self.timeout:.0f} s "
                    f"(exit {self.proc.returncode}); its log's end:\n{self.log_tail()}"
                )
            time.sleep(0.25)
        self.start_seconds = time.perf_counter() - t0
        print(f"server up at {self.url} in {self.start_seconds:.1f} s", file=sys.stderr)
        if self.wait_compiled:
            while programs_to_compile(self.url) and time.monotonic() < deadline:
                time.sleep(0.25)
            self.compiled_seconds = time.perf_counter() - t0
            print(
                f"every program compiled and run once {self.compiled_seconds:.1f} s after launch",
                file=sys.stderr,
            )
        return self

    def stop(self) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(10)

    def __exit__(self, *exc) -> None:
        rc = self.stop()
        if rc not in (0, None):
            print(f"the server exited {rc}; its log's end:\n{self.log_tail()}", file=sys.stderr)
