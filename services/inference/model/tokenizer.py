"""Byte-level tokenizer of the embedded model: every UTF-8 byte is a token.

Bytes need no vocabulary file and never fail on input, so the default model serves any
prompt the same way on every machine. Two ids past the bytes mark the start and end of a
sequence.
"""

from __future__ import annotations

from collections.abc import Sequence

BYTE_COUNT = 256
BOS_ID = 256
EOS_ID = 257
VOCAB_SIZE = 258


class ByteTokenizer:
    """Ids 0..255 are bytes, 256 = BOS, 257 = EOS."""

    vocab_size: int = VOCAB_SIZE
    bos_id: int = BOS_ID
    eos_id: int = EOS_ID

    def encode(self, text: str) -> list[int]:
        """The UTF-8 bytes of `text`; no BOS (the engine adds it)."""
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        """Text of the byte ids; specials are dropped and broken UTF-8 becomes U+FFFD.

        A stream can split a multi-byte character across chunks; decoding each chunk alone
        then shows replacement characters, so streamers should decode the ids so far.
        """
        return bytes(i for i in ids if 0 <= i < BYTE_COUNT).decode("utf-8", errors="replace")
