"""What a hostile request costs the server and the streams beside it: `python -m rosejax.serve`
(random:tiny, loopback, the default limits) started from a checkout, and for each case a
streamed request running while the hostile one is sent. One JSON line per case: the hostile
request's status, the concurrent stream's longest gap between two chunks and whether it ended
with [DONE], and the server's RSS before and after (once idle).

    python -m bench.hostile_requests                     # this checkout
    python -m bench.hostile_requests --checkout ../main  # another one, for a before/after
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time

import httpx
import psutil

CASES = {  # name -> request body (bytes)
    "prompt-20MB": b'{"prompt": "' + b"x " * (10 * 2**20) + b'", "max_tokens": 2}',
    "prompt-1MB": b'{"prompt": "' + b"x " * 2**19 + b'", "max_tokens": 2}',
    "stops-1000x1000": json.dumps(
        {"prompt": "the", "max_tokens": 64, "ignore_eos": True, "stop": ["\u4e00" * 1000] * 1000}
    ).encode(),
    "stop-id-2**31": b'{"prompt": "x", "stop_token_ids": [2147483648], "max_tokens": 2}',
    "surrogate": b'{"prompt": "abc \\ud800", "max_tokens": 2}',
}


def _stream(url: str, out: dict) -> None:
    body = {"prompt": "the", "max_tokens": 100, "ignore_eos": True, "stream": True}
    last, gaps, lines = time.monotonic(), [], []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                now = time.monotonic()
                gaps.append(now - last)
                last = now
                lines.append(line)
    out["max_gap_s"] = round(max(gaps[1:], default=0.0), 3)  # the first holds the prefill
    out["done"] = bool(lines) and lines[-1] == "data: [DONE]"
    out["errors"] = sum('"error"' in line for line in lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkout", default=os.path.dirname(os.path.dirname(__file__)) or ".")
    p.add_argument("--cases", default=",".join(CASES), help="comma-separated: " + ", ".join(CASES))
    args = p.parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "rosejax.serve", "--model", "random:tiny", "--port", str(port)]
    cmd += ["--no-warmup", "--block-size", "16", "--max-batch-size", "8", "--no-access-log"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": os.path.abspath(args.checkout)}
    server = subprocess.Popen(cmd, cwd=args.checkout, env=env, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or server.poll() is not None:
                raise RuntimeError("the server did not start")
            time.sleep(0.2)
        proc = psutil.Process(server.pid)
        _stream(url, {})  # compile what a stream needs, outside the measurements
        for name in args.cases.split(","):
            rss = proc.memory_info().rss
            out: dict = {"case": name}
            stream = threading.Thread(target=_stream, args=(url, out))
            stream.start()
            time.sleep(0.2)
            start = time.monotonic()
            try:
                r = httpx.post(url + "/v1/completions", content=CASES[name], timeout=300)
                out["status"] = r.status_code
            except httpx.TransportError as e:
                out["status"] = f"{type(e).__name__}"
            out["answer_s"] = round(time.monotonic() - start, 2)
            stream.join(300)
            time.sleep(1.0)
            out["rss_mib_before"] = round(rss / 2**20)
            out["rss_mib_after"] = round(proc.memory_info().rss / 2**20)
            print(json.dumps(out), flush=True)
    finally:
        server.terminate()
        server.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
