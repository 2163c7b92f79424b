"""The pre-generated answer table: greedy answers written once by `spine cache build`, mapped
read-only from one file by every process that runs the cache.

Why a file and mmap: the most common prompts should never reach the model, in any replica,
from the first request on. A table in the page cache is shared by every process that maps
it (each replica's PSS counts a share of it, not a copy), costs no start-up beyond a
checksum pass, and is swapped by replacing the file.

The file (little-endian):

* a header of `HEADER_BYTES`: magic, format version, entry count, index slots, the index
  and answers offsets, the file's length, the model's digest (`model_digest`), a sha256 of
  everything after the header, and the model id;
* a hash index: `slots` (a power of two, at most half full) pairs of (tag, answer offset),
  probed linearly; a tag is the key's first 8 bytes with the low bit set (0 = empty);
* the answers: each the full 32-byte key, a length and a serialized `GenerateResponse`
  (text, token ids, finish reason, prompt and completion tokens, system digest).

A key is sha256 over (model id, system, prompt, max_tokens), length-prefixed: a greedy
answer depends on nothing else. Tenants share the table (it holds no tenant's data).
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import struct
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from services.inference.config import HF_CLASS, InferenceConfig
from wire.v1 import generation_pb2

MAGIC = b"SPINEPG\x00"
VERSION = 1
HEADER_BYTES = 512
_HEADER = struct.Struct("<8sIIQQQQQ32s32sH")  # then the model id's UTF-8
_SLOT = struct.Struct("<QQ")  # tag, answer offset
_ANSWER = struct.Struct("<32sI")  # key, payload length
KEY_BYTES = 32
MAX_MODEL_ID_BYTES = HEADER_BYTES - _HEADER.size


class TableError(ValueError):
    """A file that cannot be served: the message says what is wrong with it."""


def table_key(model: str, system: str, prompt: str, max_tokens: int) -> bytes:
    """sha256 over the inputs that fix a greedy answer, length-prefixed ("ab","c" != "a","bc")."""
    parts: list[bytes] = []
    for text in (model, system, prompt, str(max_tokens)):
        data = text.encode()
        parts.append(len(data).to_bytes(8, "little"))
        parts.append(data)
    return hashlib.sha256(b"".join(parts)).digest()


def model_digest(block: InferenceConfig) -> bytes:
    """What the answers were made with, as every process can tell it from its config alone:
    sha256 of the model's id, seed and backend spec, and for a transformers directory its
    `config.json` and the names and sizes of its weight files (hashing gigabytes of weights
    at every start would cost more than the table saves)."""
    spec = {"model_id": block.model_id, "seed": block.seed, "backend": block.backend.spec()}
    digest = hashlib.sha256(json.dumps(spec, sort_keys=True, default=str).encode())
    if block.backend.class_ == HF_CLASS:
        directory = Path(str(block.backend.options.get("path", "")))
        config = directory / "config.json"
        digest.update(config.read_bytes() if config.is_file() else b"-")
        for weights in sorted(directory.glob("*.safetensors")):
            digest.update(f"{weights.name}:{weights.stat().st_size}".encode())
    return digest.digest()


def served_digests(inference: InferenceConfig) -> dict[str, bytes]:
    """Every served model's id -> its digest (what a table must match to be served)."""
    return {block.model_id: model_digest(block) for block in inference.served()}


def _tag(key: bytes) -> int:
    return int.from_bytes(key[:8], "little") | 1


def _home(key: bytes, mask: int) -> int:
    return int.from_bytes(key[8:16], "little") & mask


def write_table(path: Path, model_id: str, digest: bytes,
                answers: Iterable[tuple[bytes, generation_pb2.GenerateResponse]]) -> int:
    """Write a table to `path` atomically (a temporary file beside it, then a rename), so a
    process watching the path never maps half a file. Returns the entry count; a key
    given twice keeps its last answer."""
    model = model_id.encode()
    if len(model) > MAX_MODEL_ID_BYTES:
        raise ValueError(f"model id: at most {MAX_MODEL_ID_BYTES} bytes, got {len(model)}")
    by_key = {key: answer.SerializeToString(deterministic=True) for key, answer in answers}
    slots = 1
    while slots < 2 * max(1, len(by_key)):
        slots *= 2
    index_offset = HEADER_BYTES
    data_offset = index_offset + slots * _SLOT.size
    index = bytearray(slots * _SLOT.size)
    data = bytearray()
    for key, payload in by_key.items():
        if len(key) != KEY_BYTES:
            raise ValueError(f"key: expected {KEY_BYTES} bytes, got {len(key)}")
        slot = _home(key, slots - 1)
        while _SLOT.unpack_from(index, slot * _SLOT.size)[0]:
            slot = (slot + 1) & (slots - 1)
        _SLOT.pack_into(index, slot * _SLOT.size, _tag(key), data_offset + len(data))
        data += _ANSWER.pack(key, len(payload)) + payload
    body = bytes(index) + bytes(data)
    length = HEADER_BYTES + len(body)
    header = _HEADER.pack(MAGIC, VERSION, 0, len(by_key), slots, index_offset, data_offset, length, digest,
                          hashlib.sha256(body).digest(), len(model)) + model
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as out:
        out.write(header.ljust(HEADER_BYTES, b"\0"))
        out.write(body)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, path)
    return len(by_key)


class PregeneratedTable:
    """One mapped table file: `lookup` is a few struct reads on the shared pages."""

    def __init__(self, path: Path, expected: Mapping[str, bytes] | None = None) -> None:
        """Map `path` read-only and check it whole (TableError: truncated, corrupt, another
        format, or — given `expected`, served model id -> digest — a model not served here)."""
        self.path = Path(path)
        with open(self.path, "rb") as file:
            size = os.fstat(file.fileno()).st_size
            if size < HEADER_BYTES:
                raise TableError(f"truncated: {size} bytes, shorter than the {HEADER_BYTES}-byte header")
            self._map = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            self._check(size, expected)
        except BaseException:
            self._map.close()
            raise

    def _check(self, size: int, expected: Mapping[str, bytes] | None) -> None:
        (magic, version, _, entries, slots, index_offset, data_offset, length, digest, checksum,
         model_len) = _HEADER.unpack_from(self._map, 0)
        if magic != MAGIC:
            raise TableError("not a pre-generated answer table (bad magic)")
        if version != VERSION:
            raise TableError(f"format version {version}, this spine reads {VERSION}")
        if length != size:
            raise TableError(f"truncated or extended: the header says {length} bytes, the file has {size}")
        if (slots & (slots - 1) or slots <= entries or model_len > MAX_MODEL_ID_BYTES
                or index_offset != HEADER_BYTES or data_offset != index_offset + slots * _SLOT.size
                or data_offset > size):
            raise TableError("corrupt header (sizes and offsets disagree)")
        if hashlib.sha256(self._map[HEADER_BYTES:]).digest() != checksum:
            raise TableError("corrupt: the checksum of the index and answers does not match")
        self.model_id = bytes(self._map[_HEADER.size:_HEADER.size + model_len]).decode()
        self.model_digest: bytes = digest
        self.entries: int = entries
        self._slots, self._mask, self._index = slots, slots - 1, index_offset
        if expected is not None:
            if self.model_id not in expected:
                raise TableError(f"made for model {self.model_id!r}, which is not served here "
                                 f"(served: {', '.join(sorted(expected))})")
            if expected[self.model_id] != digest:
                raise TableError(f"made for another {self.model_id!r} (its weights or config digest differs)")

    def lookup(self, key: bytes) -> generation_pb2.GenerateResponse | None:
        """The stored answer for `key`, or None."""
        mapped, tag, mask, index = self._map, _tag(key), self._mask, self._index
        slot = _home(key, mask)
        for _ in range(self._slots):
            found, offset = _SLOT.unpack_from(mapped, index + slot * _SLOT.size)
            if not found:
                return None
            if found == tag:
                stored, length = _ANSWER.unpack_from(mapped, offset)
                if stored == key:
                    start = offset + _ANSWER.size
                    return generation_pb2.GenerateResponse.FromString(mapped[start:start + length])
            slot = (slot + 1) & mask
        return None

    def close(self) -> None:
        """Unmap now (a table no lookup can still hold; otherwise dropping it is enough)."""
        self._map.close()


def describe(table: PregeneratedTable) -> dict[str, Any]:
    """What a log line or the builder prints about a table."""
    return {"path": str(table.path), "model": table.model_id, "entries": table.entries,
            "digest": table.model_digest.hex()[:16]}
