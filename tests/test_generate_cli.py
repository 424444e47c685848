"""`python -m rosejax.generate` on CPU with random weights."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rosejax.generate import build_parser, main

ARGS = ["--model", "random:tiny", "--max-new-tokens", "6", "--no-warmup", "--block-size", "16"]


def test_generates_and_summarises(capsys):
    assert main([*ARGS, "--prompt", "Hello", "--prompt", "The sky is", "--ignore-eos"]) == 0
    out, err = capsys.readouterr()
    assert out.count("[finish: length]") == 2 and out.startswith("Hello")
    assert "12 tokens" in err and "tok/s" in err and "compile" in err


def test_stream_prints_text_and_ttft(capsys):
    assert (
        main([*ARGS, "--prompt", "Hello", "--stream", "--temperature", "0.8", "--seed", "1"]) == 0
    )
    _, err = capsys.readouterr()
    assert "TTFT" in err and "n/a" not in err


def test_stream_of_several_prompts_labels_each_piece(capsys):
    prompts = ["--prompt", "Hello", "--prompt", "The sky is"]
    assert main([*ARGS, *prompts, "--stream", "--ignore-eos", "--logprobs", "2"]) == 0
    out = capsys.readouterr().out
    assert "[0] Hello" in out and "[1] The sky is" in out, out
    lines = [line for line in out.splitlines() if line]
    assert all(line.startswith(("[0] ", "[1] ")) for line in lines), out
    # then a line per generated token: its logprob and rank, then the top two but itself
    logprob_lines = [line for line in lines if "(rank " in line]
    assert len(logprob_lines) == 12 and all(" | " in line for line in logprob_lines)


@pytest.mark.parametrize("kind", ["missing", "directory", "not-utf8"])
def test_unreadable_prompt_file_is_a_usage_error(tmp_path, capsys, kind):
    path = tmp_path / "prompts.txt"
    if kind == "directory":
        path.mkdir()
    elif kind == "not-utf8":
        path.write_bytes(b"caf\xe9\n")
    with pytest.raises(SystemExit) as e:
        main([*ARGS, "--prompt-file", str(path)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--prompt-file" in err and "Traceback" not in err, err


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--top-p", "2"], "top_p"),
        (["--temperature", "-1"], "temperature"),
        (["--max-new-tokens", "0"], "max_tokens"),
        (["--logprobs", "21"], "logprobs"),
    ],
)
def test_bad_values_exit_2_with_message(capsys, extra, message):
    assert main([*ARGS, "--prompt", "Hello", *extra]) == 2
    assert message in capsys.readouterr().err


def test_missing_checkpoint_says_what_to_pass(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "rosejax.generate",
            "--model",
            str(tmp_path / "none"),
            "--prompt",
            "x",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "does not exist" in proc.stderr


def test_help_explains_every_flag():
    for action in build_parser()._actions:
        assert action.help, f"{action.dest} has no help"
