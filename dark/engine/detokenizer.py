"""Incremental detokenization that never emits half a character, and stop-string handling."""
from __future__ import annotations

from .sequence import Sequence


def detokenize_step(tokenizer, seq: Sequence, final: bool = False) -> None:
    """Extend seq.text with the text of newly sampled tokens.

    Decoding a short window (from a few tokens before the new ones) keeps the cost flat; a window that ends
    inside a multi-byte character decodes to U+FFFD, and is held back until the character completes.
    """
    ids, start = seq.token_ids, seq.num_prompt_tokens  # the window only: no copy of the whole output per token
    decode = _decoder(tokenizer)
    before = decode(ids[start + seq.detok_prefix:start + seq.detok_read])
    after = decode(ids[start + seq.detok_prefix:])
    if len(after) > len(before) and (final or not after.endswith("\ufffd")):
        seq.text += after[len(before):]
        seq.detok_prefix, seq.detok_read = seq.detok_read, len(ids) - start


def _decoder(tokenizer):
    """ids -> text without special tokens: the Rust tokenizer itself when the wrapper would add nothing to it (no
    clean-up of spaces), which halves the cost of the two calls per sampled token; else the wrapper's decode."""
    fast = getattr(tokenizer, "_dark_decode", None)
    if fast is None:
        rust = getattr(tokenizer, "_tokenizer", None)
        if rust is not None and hasattr(rust, "decode") and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
            fast = lambda ids: rust.decode(ids, skip_special_tokens=True)  # noqa: E731
        else:
            fast = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
        try:
            tokenizer._dark_decode = fast
        except AttributeError:  # a tokenizer that takes no new attributes: decide again next time
            pass
    return fast


def find_stop(seq: Sequence, searched_from: int) -> int:
    """Index in seq.text where a stop string starts (searching text added since searched_from), or -1."""
    hits = [seq.text.find(stop, max(0, searched_from - len(stop) + 1)) for stop in seq.params.stop]
    hits = [h for h in hits if h >= 0]
    return min(hits) if hits else -1


def releasable(seq: Sequence) -> int:
    """How much of seq.text may be sent: while running, the tail that could start a stop string is held."""
    if seq.finish_reason is not None or not seq.params.stop:
        return len(seq.text)
    hold = max(len(s) for s in seq.params.stop) - 1
    return max(seq.emitted, len(seq.text) - hold)
