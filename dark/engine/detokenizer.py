"""Incremental detokenization that never emits half a character, and stop-string handling."""
from __future__ import annotations

from .sequence import Sequence


def detokenize_step(tokenizer, seq: Sequence, final: bool = False) -> None:
    """Extend seq.text with the text of newly sampled tokens.

    Decoding a short window (from a few tokens before the new ones) keeps the cost flat; a window that ends
    inside a multi-byte character decodes to U+FFFD, and is held back until the character completes.
    """
    ids = seq.output_ids
    before = tokenizer.decode(ids[seq.detok_prefix:seq.detok_read], skip_special_tokens=True)
    after = tokenizer.decode(ids[seq.detok_prefix:], skip_special_tokens=True)
    if len(after) > len(before) and (final or not after.endswith("\ufffd")):
        seq.text += after[len(before):]
        seq.detok_prefix, seq.detok_read = seq.detok_read, len(ids)


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
