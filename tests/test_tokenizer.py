"""Tokenizer loading and streaming detokenization against tokenizer.decode."""

from __future__ import annotations

import json
import os
import shutil
import socket

import numpy as np
import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st

from rosejax.tokenizer import (
    _TABLES,
    FastTokenizer,
    IncrementalDetokenizer,
    _byte_table,
    load_tokenizer,
    packaged_gpt2_tokenizer_path,
    warm_tokenizer,
)

TEXTS = [
    "Hello world",
    "Crème brûlée, naïve café, São Paulo, Zürich, Ærøskøbing",
    "e\u0301 combining acute, n\u0303",
    "你好，世界。日本語のテキスト。한국어 문장.",
    "emoji 😀🎉👍🏽 and more 🤖",
    "family 👨‍👩‍👧‍👦 rainbow flag 🏳️‍🌈 flags 🇯🇵🇫🇷🇺🇸 keycap 1️⃣",
    "mixed: ASCII, Ελληνικά, русский, עברית, العربية, हिन्दी, ไทย 🧑🏿‍🚀 ∮ E⋅da = Q",
    "<|endoftext|>special in the middle<|endoftext|> 😀<|endoftext|>",
    "   leading spaces\n\nnewlines\ttabs  ",
]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("random:gpt2")


def stream(detok: IncrementalDetokenizer, ids: list[int], chunk: int = 1) -> list[str]:
    """The pieces of `ids` fed one at a time (`add`) or `chunk` at a time (`add_many`), then
    the flush."""
    if chunk == 1:
        pieces = [detok.add(i) for i in ids]
    else:
        pieces = [detok.add_many(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    pieces.append(detok.flush())
    return pieces


def check_stream(tok, ids: list[int], **kwargs) -> None:
    expected = tok.decode(ids, **kwargs)
    for generic in (False, True):

        def detokenizer(generic=generic):
            detok = IncrementalDetokenizer(tok, **kwargs)
            if generic:  # force the window path that non-byte-level tokenizers take
                detok._table, detok._ids, detok._prefix, detok._read = None, [], 0, 0
            return detok

        pieces = stream(detokenizer(), ids)
        assert "".join(pieces) == expected, (generic, ids)
        if "\ufffd" not in expected:
            assert not any("\ufffd" in p for p in pieces), (generic, ids, pieces)
        # Several ids at once give what one at a time gives over the same ids, joined.
        for chunk in (3, 7):
            per_id = pieces[:-1]
            joined = ["".join(per_id[i : i + chunk]) for i in range(0, len(ids), chunk)]
            assert stream(detokenizer(), ids, chunk) == [*joined, pieces[-1]], (generic, ids)


@pytest.mark.parametrize("text", TEXTS)
def test_stream_matches_decode(tok, text):
    ids = tok.encode(text)
    assert tok.decode(ids) == text  # GPT-2's byte-level BPE is lossless
    check_stream(tok, ids)
    check_stream(tok, ids, skip_special_tokens=True)


def test_multibyte_chars_are_held_back_whole(tok):
    ids = tok.encode("👨‍👩‍👧 你好")
    detok = IncrementalDetokenizer(tok)
    pieces = stream(detok, ids)
    assert len(ids) > len([p for p in pieces if p])  # some tokens only carried partial bytes
    for p in pieces:
        assert p.encode("utf-8").decode("utf-8") == p and "\ufffd" not in p


def test_invalid_bytes_flush_like_decode(tok):
    # 447 is a lone lead byte (the start of a 3-byte character): decode gives U+FFFD for it.
    ids = [447, 15496, 447]
    assert "\ufffd" in tok.decode(ids)
    check_stream(tok, ids)
    detok = IncrementalDetokenizer(tok)
    assert detok.add(447) == ""  # held back: it might still complete
    assert detok.add(246) == "\u2018"  # ... and here it does


def test_no_ids_no_text(tok):
    detok = IncrementalDetokenizer(tok)
    assert detok.add(447) == "" and detok.add_many([]) == "" and detok.add(246) == "\u2018"


def test_byte_level_path_never_decodes(tok, monkeypatch):
    detok = IncrementalDetokenizer(tok)
    monkeypatch.setattr(tok, "decode", lambda *a, **k: pytest.fail("decode called"))
    for i in range(0, 50000, 997):
        detok.add(i)
    detok.flush()


@pytest.mark.parametrize("ids", [[5, 10**6], [-1], [3, 4, -2, 7]])
def test_out_of_vocab_id(tok, ids):
    bad = next(i for i in ids if not 0 <= i < len(tok))
    with pytest.raises(ValueError, match=f"token id {bad} outside the vocabulary"):
        IncrementalDetokenizer(tok).add_many(ids)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        IncrementalDetokenizer(tok).add(len(tok) + 5)


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_random_ids_match_decode(tok, fragments, data):
    # Half the draws favour tokens that are fragments of a UTF-8 character (a few hundred of the
    # vocab), so incomplete, completed and never-completed characters all come up often.
    any_id = st.integers(0, len(tok) - 1)
    ids_from = data.draw(st.sampled_from([any_id, st.one_of(st.sampled_from(fragments), any_id)]))
    ids = data.draw(st.lists(ids_from, max_size=40))
    check_stream(tok, ids)


@pytest.fixture(scope="module")
def fragments(tok) -> list[int]:
    def is_fragment(b: bytes) -> bool:
        try:
            b.decode("utf-8")
            return False
        except UnicodeDecodeError:
            return True

    return [i for i, b in enumerate(_byte_table(tok, False)) if is_fragment(b)]


@settings(max_examples=100, deadline=None)
@given(text=st.text(max_size=30))
def test_random_text_matches_decode(tok, text):
    check_stream(tok, tok.encode(text))


def test_packaged_path():
    path = packaged_gpt2_tokenizer_path()
    assert os.path.isfile(os.path.join(path, "tokenizer.json"))
    assert os.path.isfile(os.path.join(path, "LICENSE"))


@pytest.fixture
def no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("network access attempted")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def test_load_random_model(tok, no_network):
    assert load_tokenizer("random:gpt2").encode("Hello world") == [15496, 995]
    assert tok.eos_token_id == 50256 and len(tok) == 50257


def test_load_local_dir(tmp_path, no_network):
    shutil.copytree(packaged_gpt2_tokenizer_path(), tmp_path / "m")
    (tmp_path / "m" / "config.json").write_text('{"model_type": "gpt2"}')
    assert load_tokenizer(str(tmp_path / "m")).encode("Hello world") == [15496, 995]


def test_missing_tokenizer_files(tmp_path, no_network):
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(ValueError, match="--tokenizer"):
        load_tokenizer(str(tmp_path))
    # An explicit tokenizer wins over the model directory.
    t = load_tokenizer(str(tmp_path), tokenizer=packaged_gpt2_tokenizer_path())
    assert t.encode("Hello world") == [15496, 995]
    with pytest.raises(ValueError, match="not a directory"):
        load_tokenizer("./no/such/model")


TOKENIZER_DIRS = [
    packaged_gpt2_tokenizer_path(),
    *(
        os.path.join(os.path.dirname(__file__), "..", "..", "shared", "tokenizers", name)
        for name in ("qwen3", "llama3")
    ),
]
TOKENIZER_NAMES = ("gpt2", "qwen3", "llama3")
SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    "path, saved",
    [
        *(
            pytest.param(p, False, id=n)
            for p, n in zip(TOKENIZER_DIRS, TOKENIZER_NAMES, strict=True)
        ),
        pytest.param(TOKENIZER_DIRS[1], True, id="qwen3-saved"),  # extra tokens, a .jinja file
        *(
            pytest.param(TOKENIZER_DIRS[i], True, id=f"{TOKENIZER_NAMES[i]}-saved", marks=SLOW)
            for i in (0, 2)
        ),
    ],
)
def test_local_tokenizer_equals_autotokenizer(path, saved, tmp_path, no_network):
    """A directory with tokenizer.json (as shipped, or as transformers' save_pretrained writes
    it) loads as a `FastTokenizer`, without transformers; it encodes, decodes, names its tokens
    and renders its chat template as the class AutoTokenizer picks from its
    tokenizer_config.json."""
    if not os.path.isdir(path):
        pytest.skip("needs ../shared/tokenizers")
    from transformers import AutoTokenizer

    auto = AutoTokenizer.from_pretrained(
        path, local_files_only=True, clean_up_tokenization_spaces=False
    )
    if saved:
        auto.save_pretrained(tmp_path)
        path = str(tmp_path)
    ours = load_tokenizer("unused", path)
    assert isinstance(ours, FastTokenizer)
    specials = "".join(auto.all_special_tokens[:8])
    for text in [*TEXTS, f"{specials} x{specials}"]:
        for add in (True, False):
            ids = auto.encode(text, add_special_tokens=add)
            assert ours.encode(text, add_special_tokens=add) == ids, text
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == auto.decode(
                ids, skip_special_tokens=skip
            )
    ids = np.random.default_rng().integers(0, len(auto), 200).tolist()
    assert ours.decode(ids) == auto.decode(ids)
    assert ours.convert_ids_to_tokens(ids) == auto.convert_ids_to_tokens(ids)
    assert ours.special_tokens_map == auto.special_tokens_map
    assert ours.get_vocab() == auto.get_vocab() and len(ours) == len(auto)
    assert (ours.eos_token_id, ours.bos_token_id, ours.all_special_ids) == (
        auto.eos_token_id,
        auto.bos_token_id,
        auto.all_special_ids,
    )
    assert ours.chat_template == auto.chat_template
    if auto.chat_template:
        chat = [{"role": "user", "content": TEXTS[4]}, {"role": "assistant", "content": "ok"}]
        for gen in (True, False):
            kw = dict(tokenize=True, add_generation_prompt=gen)
            assert ours.apply_chat_template(chat, **kw) == auto.apply_chat_template(chat, **kw)


def _edit_config(**keys):
    def edit(path):
        with open(path / "tokenizer_config.json") as f:
            config = json.load(f)
        with open(path / "tokenizer_config.json", "w") as f:
            json.dump(config | keys, f)

    return edit


def _add_file(name, text):
    return lambda path: (path / name).write_text(text)


# tokenizer_config.json edits and files that transformers reads, and whether they change what
# it encodes (from tokenizer.json's own tokens).
TRANSFORMERS_READS = {
    "a token made special": (_edit_config(additional_special_tokens=["Hello"]), True),
    "a new special token": (_edit_config(additional_special_tokens=["<|im_start|>"]), True),
    "split_special_tokens": (_edit_config(split_special_tokens=True), True),
    "re-flagged added token": (
        _edit_config(
            added_tokens_decoder={
                "50256": {
                    "content": "<|endoftext|>",
                    "lstrip": True,
                    "normalized": False,
                    "rstrip": True,
                    "single_word": False,
                    "special": True,
                }
            }
        ),
        True,
    ),
    "an unknown key": (_edit_config(do_lower_case=True), False),
    "special_tokens_map.json": (_add_file("special_tokens_map.json", "{}"), False),
    "a mistral model": (_add_file("config.json", '{"model_type": "mistral"}'), False),
}


@pytest.mark.parametrize("case", TRANSFORMERS_READS)
def test_tokenizer_configs_transformers_reads_load_with_transformers(case, tmp_path):
    """Where transformers would encode otherwise than tokenizer.json alone, or might, the
    tokenizer is transformers' own class; where it does, a `FastTokenizer` would differ."""
    from transformers import PreTrainedTokenizerFast

    edit, changes = TRANSFORMERS_READS[case]
    path = tmp_path / "tok"
    shutil.copytree(packaged_gpt2_tokenizer_path(), path)
    edit(path)
    ours = load_tokenizer("unused", str(path))
    assert isinstance(ours, PreTrainedTokenizerFast)
    texts = ["Helloworld", " <|endoftext|>Hello<|endoftext|> x", "<|im_start|>hi"]
    fast = FastTokenizer(
        str(path), tokenizers.Tokenizer.from_file(str(path / "tokenizer.json")), {}, None
    )
    assert changes == any(fast.encode(t) != ours.encode(t) for t in texts)


def test_warm_tokenizer_makes_what_a_first_request_needs():
    """Once a server serves it builds the detokenizer's byte table and transformers' tokenizer
    for the chat template; a template that fails does not fail it."""
    ours = load_tokenizer("random:gpt2")
    assert ours not in _TABLES and ours._transformers is None
    warm_tokenizer(ours)  # no chat template: transformers stays unloaded
    assert _TABLES[ours][2] == _byte_table(ours, False) and ours._transformers is None
    ours.chat_template = "{{ raise_exception('no') }}"
    warm_tokenizer(ours)
    assert ours._transformers is not None


def test_loading_a_local_tokenizer_imports_no_torch():
    """The server's start does not pay for importing transformers or torch (seconds on a GPU
    host)."""
    import subprocess
    import sys

    code = (
        "import sys, rosejax, rosejax.engine.data_parallel, rosejax.serve.app\n"
        "from rosejax.tokenizer import load_tokenizer\n"
        "load_tokenizer('random:gpt2')\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "assert 'transformers' not in sys.modules, 'transformers was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
