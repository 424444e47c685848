"""Tokenizer loading (offline for local paths and `random:` models) and streaming detokenization."""

from __future__ import annotations

import codecs
import importlib.resources
import os
import weakref
from collections.abc import Sequence

# PreTrainedTokenizerFast alone, not AutoTokenizer: resolving an auto class imports
# transformers' model configs and with them torch, ~6 s of a server's start on a GPU host.
from transformers import PreTrainedTokenizerFast

# Files that make a directory loadable by AutoTokenizer (any one of them is enough).
_TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "tokenizer.model")


def packaged_gpt2_tokenizer_path() -> str:
    """Directory of the GPT-2 tokenizer files shipped inside the package (MIT, see its LICENSE)."""
    # A plain directory on disk for every normal (non-zip) install, which is what setuptools makes.
    return str(importlib.resources.files("rosejax") / "tokenizer_data")


def load_tokenizer(model: str, tokenizer: str | None = None) -> PreTrainedTokenizerFast:
    """The tokenizer for `model`: `tokenizer` (path or hub id) if given, else the model's own.

    `random:*` models have no files of their own and use the packaged GPT-2 tokenizer. Local
    directories load with `local_files_only=True`, so they never touch the network.
    """
    if tokenizer is not None:
        source = tokenizer
    elif model.startswith("random:"):
        source = packaged_gpt2_tokenizer_path()
    else:
        source = model
    expanded = os.path.expanduser(source)
    local = os.path.isdir(expanded)
    if local and not any(os.path.isfile(os.path.join(expanded, f)) for f in _TOKENIZER_FILES):
        raise ValueError(
            f"no tokenizer files ({', '.join(_TOKENIZER_FILES)}) in {source!r}; pass tokenizer= "
            f"(--tokenizer) with a tokenizer directory or hub id, e.g. gpt2, or the GPT-2 one "
            f"rosejax carries ({packaged_gpt2_tokenizer_path()})"
        )
    if not local and (os.path.exists(expanded) or source.startswith((".", "/", "~"))):
        raise ValueError(f"tokenizer path {source!r} is not a directory")
    # Cleanup strips spaces before punctuation (transformers 4.x may default it on for GPT-2),
    # which would make decode() disagree with the byte stream the detokenizer streams.
    if local and os.path.isfile(os.path.join(expanded, "tokenizer.json")):
        return PreTrainedTokenizerFast.from_pretrained(
            expanded, local_files_only=True, clean_up_tokenization_spaces=False
        )
    from transformers import AutoTokenizer  # slow vocab files, hub ids

    return AutoTokenizer.from_pretrained(
        expanded if local else source, local_files_only=local, clean_up_tokenization_spaces=False
    )


def chat_prompt_ids(
    tokenizer: PreTrainedTokenizerFast,
    messages: Sequence[dict],
    *,
    add_generation_prompt: bool = True,
    chat_template: str | None = None,
    chat_template_kwargs: dict | None = None,
    add_special_tokens: bool = False,
) -> list[int]:
    """One conversation's prompt ids through the tokenizer's chat template (or `chat_template`):
    the rendered text tokenized without adding special tokens again, which is what
    `tokenizer.apply_chat_template(messages, tokenize=True)` gives (the template writes BOS
    itself; `add_special_tokens` adds the tokenizer's on top, as vLLM's /tokenize may).
    `chat_template_kwargs` go to the template, e.g. Qwen3's `enable_thinking`."""
    if not (chat_template or getattr(tokenizer, "chat_template", None)):
        raise ValueError(
            "the tokenizer has no chat template (GPT-2's has none): pass chat_template, or "
            "use generate() with a plain prompt"
        )
    text = tokenizer.apply_chat_template(
        list(messages),
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
        chat_template=chat_template,
        **(chat_template_kwargs or {}),
    )
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (the byte-level BPE alphabet)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    bs += range(ord("®"), ord("ÿ") + 1)
    cs = list(bs)
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


_BYTE_DECODER = {c: b for b, c in _bytes_to_unicode().items()}
# tokenizer -> (len(tokenizer), skip_special_tokens, table); rebuilt when tokens are added.
_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _is_byte_level(tokenizer: PreTrainedTokenizerFast) -> bool:
    import tokenizers.decoders

    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    return isinstance(decoder, tokenizers.decoders.ByteLevel)


def _byte_table(tokenizer: PreTrainedTokenizerFast, skip_special: bool) -> list[bytes] | None:
    """id -> the bytes that the ByteLevel decoder turns that token into; None for a tokenizer
    that is not byte-level. Cached per tokenizer: every request's detokenizer asks."""
    cached = _TABLES.get(tokenizer)
    if cached is not None and cached[:2] == (len(tokenizer), skip_special):
        return cached[2]
    table = None
    if _is_byte_level(tokenizer):
        vocab = tokenizer.backend_tokenizer.get_vocab(with_added_tokens=True)  # token -> id
        table = [b""] * (max(vocab.values()) + 1)
        skip = set(tokenizer.all_special_ids) if skip_special else set()
        for token, i in vocab.items():
            if i in skip:
                continue
            # The same rule as tokenizers' ByteLevel decoder (added tokens included): map every
            # char back to its byte, or, if any char is outside the alphabet, use the token's UTF-8.
            try:
                table[i] = bytes(_BYTE_DECODER[c] for c in token)
            except KeyError:
                table[i] = token.encode("utf-8")
    _TABLES[tokenizer] = (len(tokenizer), skip_special, table)
    return table


_UTF8_DECODER = codecs.getincrementaldecoder("utf-8")


class IncrementalDetokenizer:
    """Turns a stream of token ids into text pieces whose concatenation is `tokenizer.decode(ids)`.

    Byte-level BPE tokenizers (GPT-2's) take the exact O(1)-per-token path: each id maps to its
    bytes and an incremental UTF-8 decoder holds back an incomplete character until its last
    byte arrives; bytes that can never complete become U+FFFD just as in `decode`. Any other
    tokenizer uses vLLM's prefix/read offset window: decode only the tokens since the last emitted
    piece and hold text that ends in U+FFFD (best effort: exact for common tokenizers).
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerFast,
        skip_special_tokens: bool = False,
        vocab_size: int | None = None,
    ) -> None:
        """`vocab_size`: the model's, when it has more rows than the tokenizer has tokens
        (Qwen3: 151,936 against 151,669): ids in between decode to nothing, as in vLLM, rather
        than raise."""
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.vocab_size = vocab_size
        self._table = _byte_table(tokenizer, skip_special_tokens)
        if self._table is not None:
            self._utf8 = _UTF8_DECODER(errors="replace")
        else:
            self._ids: list[int] = []
            self._prefix = self._read = 0  # ids[prefix:read] were decoded into emitted text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Feed one token id; returns the newly completed text (possibly '')."""
        return self.add_many([int(token_id)])

    def add_many(self, token_ids: Sequence[int]) -> str:
        """Feed several token ids (one request's share of a decode window); returns the newly
        completed text: what `add` for each in turn returns, joined."""
        if self._table is None:
            pieces = []
            for token_id in token_ids:
                self._ids.append(token_id)
                pieces.append(self._window(final=False))
            return "".join(pieces)
        table = self._table
        if token_ids and not (0 <= min(token_ids) and max(token_ids) < len(table)):
            limit = max(len(table), self.vocab_size or 0)
            bad = next((t for t in token_ids if not 0 <= t < limit), None)
            if bad is not None:
                raise ValueError(f"token id {bad} outside the vocabulary [0, {limit})")
            n = len(table)
            return self._utf8.decode(b"".join([table[t] if t < n else b"" for t in token_ids]))
        return self._utf8.decode(b"".join([table[t] for t in token_ids]))

    def _window(self, final: bool) -> str:
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        if not final and (len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd")):
            return ""  # an incomplete character (or nothing new yet): wait for more tokens
        self._prefix, self._read = self._read, len(self._ids)
        return new_text[len(prefix_text) :]

    def flush(self) -> str:
        """At end of stream: whatever is held back (undecodable bytes become U+FFFD)."""
        if self._table is not None:
            return self._utf8.decode(b"", final=True)
        return self._window(final=True)


class TokenTexts(dict):
    """id -> the text of that token alone (`tokenizer.decode([id])`: vLLM's `decoded_token` of
    a logprob), each id decoded once: logprobs name up to 21 tokens per generated token. A
    byte-level tokenizer's text is its bytes as UTF-8 (what `decode` makes of them: equal for
    every id of GPT-2's, Llama 3's and Qwen3's), about 50x faster than `decode`. Ids the
    tokenizer does not have (a model's padded vocabulary rows) are ''. A dict, so a known id
    is a plain lookup."""

    def __init__(self, tokenizer: PreTrainedTokenizerFast) -> None:
        super().__init__()
        self.tokenizer = tokenizer
        self._table = _byte_table(tokenizer, skip_special=False)

    def __missing__(self, token_id: int) -> str:
        if self._table is not None:
            known = token_id < len(self._table)
            text = self._table[token_id].decode("utf-8", "replace") if known else ""
        else:
            known = token_id < len(self.tokenizer)
            text = self.tokenizer.decode([token_id]) if known else ""
        self[token_id] = text
        return text
