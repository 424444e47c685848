"""Fuzz the OpenAI-compatible server from its own /openapi.json with schemathesis: every request
body the schema allows, and many it does not, against a random:tiny server on a loopback port.
The verdict is the number of 5xx answers, which must be 0 (every user error is a 4xx); each
other schemathesis check is reported beside it. Needs the test extra (schemathesis).

    python -m bench.fuzz_server --max-examples 500 --seed 1

prints one JSON line: the `st` command, requests sent, answers by status, 5xx count and the
first 5xx and unanswered requests (status 0: no answer within schemathesis's 120 s, or the
connection dropped), the checks that failed, and whether the server was left idle (no request,
no KV block) with its RSS.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def fuzz(
    url: str,
    max_examples: int,
    seed: int = 1,
    max_time: float | None = None,
    workers: int = 1,
    extra_args: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Run schemathesis (`st run`) against the server at `url` (loopback only); a summary."""
    host = url.split("://", 1)[-1].split(":", 1)[0]
    if host not in ("127.0.0.1", "localhost", "::1"):
        raise ValueError(f"fuzz only a loopback server, not {url}")
    st = shutil.which("st") or shutil.which("schemathesis")
    if st is None:
        raise RuntimeError("schemathesis is not installed: pip install -e '.[test]'")
    with tempfile.TemporaryDirectory() as tmp:
        har = os.path.join(tmp, "requests.har")
        cmd = [
            st,
            "run",
            f"{url}/openapi.json",
            "--max-examples",
            str(max_examples),
            "--seed",
            str(seed),
            "--workers",
            str(workers),
            "--request-timeout",
            "120",
            "--generation-database",
            "none",
            "--report",
            "har",
            "--report-har-path",
            har,
            "--no-color",
            "--output-sanitize",  # a failure's reproduction with its real values (a local server)
            "false",
            *(["--max-time", str(int(max_time))] if max_time else []),
            *extra_args,
        ]
        start = time.monotonic()
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp)
        seconds = time.monotonic() - start
        with open(har) as f:
            entries = json.load(f)["log"]["entries"]
    statuses = collections.Counter(e["response"]["status"] for e in entries)
    server_errors = [_request_of(e) for e in entries if e["response"]["status"] >= 500]
    # Status 0: no answer came (the client's 120 s timeout, or the connection dropped).
    unanswered = [_request_of(e) for e in entries if e["response"]["status"] == 0]
    failed = sorted(
        {line.split("- ", 1)[1].strip() for line in proc.stdout.splitlines() if "- ST" in line}
    )
    return {
        "command": " ".join(["st", *cmd[1:]]).replace(tmp, "$TMP"),
        "seconds": round(seconds, 1),
        "requests": len(entries),
        "statuses": dict(sorted(statuses.items())),
        "server_errors": len(server_errors),
        "server_error_requests": server_errors[:20],
        "unanswered_requests": unanswered[:20],
        "checks_failed": failed,
        # schemathesis's own reproduction of each failure it reports
        "reproduce": [line.strip() for line in proc.stdout.splitlines() if "curl " in line][:10],
        "st_exit_code": proc.returncode,
        "st_summary": proc.stdout.split("SUMMARY", 1)[-1].strip()[-2000:],
    }


def _request_of(entry: dict) -> dict:
    """A HAR entry's request as the summary shows it: method, URL, status, ms, body (cut)."""
    request = entry["request"]
    return {
        "method": request["method"],
        "url": request["url"],
        "status": entry["response"]["status"],
        "ms": round(entry.get("time", 0)),
        "body": request.get("postData", {}).get("text", "")[:500],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-examples", type=int, default=200, help="per API operation")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--max-time", type=float, default=600, help="seconds for the whole run")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--max-batch-size", type=int, default=8)
    args = p.parse_args(argv)

    import psutil

    from rosejax import LLM
    from rosejax.serve import create_app
    from rosejax.serve.server import ServerThread

    llm = LLM("random:tiny", warmup=False, max_batch_size=args.max_batch_size, block_size=16)
    llm.engine.tokenizer.chat_template = TEMPLATE
    with ServerThread(create_app(llm.engine, "tiny")) as server:
        rss_before = psutil.Process().memory_info().rss
        summary = fuzz(server.url, args.max_examples, args.seed, args.max_time, args.workers)
        engine, deadline = llm.engine, time.monotonic() + 30
        while engine.has_unfinished_requests() and time.monotonic() < deadline:
            time.sleep(0.1)
        summary["server_after"] = {
            "requests_left": len(engine.scheduler.running) + len(engine.scheduler.waiting),
            "kv_blocks_used": engine.allocator.num_used_blocks,
            "rss_mib_before": round(rss_before / 2**20),
            "rss_mib_after": round(psutil.Process().memory_info().rss / 2**20),
        }
    print(json.dumps(summary))
    return 1 if summary["server_errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
