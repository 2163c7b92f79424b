"""The Logs servicer: one structured JSON line per request, written in batches.

Each record becomes one line (`ts`, `request_id`, `tenant`, `model`, `status`, `latency_ms`,
`layout`, `cached`, `shadow`, `fields`) with secrets redacted before it is queued, so nothing
unredacted is ever held for writing. Lines go through a `BatchedLineWriter`: the request pays
for encoding and one ring append, the disk is someone else's thread.

The ring stays in host memory even in the spine: a file write needs the bytes on the host, so a
device copy would add a transfer per flush and save nothing. `device` is accepted so that every
service is built the same way.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from json.encoder import encode_basestring_ascii
from pathlib import Path
from typing import Any

import grpc

from services.common import Clock, DeviceState
from services.common.redact import redact_mapping, redact_text
from services.logs.api import APPEND_BATCH
from services.logs.config import LogsConfig
from services.logs.ring import BatchedLineWriter, LogsClosedError
from services.pipeline.batch_rpc import ItemError, StatusError
from services.pipeline.interface import NO_OPTIONS, CallOptions
from wire.v1 import logs_pb2, logs_pb2_grpc


class LogsService(logs_pb2_grpc.LogsServicer):
    """Writes request logs; `append_batch` is the batcher's one ring append per micro-batch."""

    def __init__(
        self, config: LogsConfig, device: DeviceState | None = None, clock: Clock = time.time,
        run_dir: str | Path = ".",
    ) -> None:
        self.config = config
        self.path = config.path_in(run_dir)  # where the lines go
        self.device = device
        self._clock = clock
        self._writer = BatchedLineWriter(
            self.path,
            capacity=config.ring_capacity,
            batch_lines=config.batch_lines,
            flush_interval_s=config.flush_interval_s,
            full_wait_s=config.full_wait_s,
            fsync=config.fsync,
        )

    # -- in-process API -------------------------------------------------------------------

    def encode(self, record: logs_pb2.LogRecord) -> bytes:
        """The record's JSON line, redacted; ValueError naming the field if it cannot be one."""
        if not math.isfinite(record.latency_ms) or record.latency_ms < 0:
            raise ValueError(f"latency_ms: expected a finite number >= 0, got {record.latency_ms!r}")
        # The keys are ours (none names a secret), so only the values are screened; the
        # client's own `fields` go through the whole rule, keys included. The line is what
        # `json.dumps(entry, separators=(",", ":"))` makes of them, in its key order,
        # assembled here: json's C string escaper on each value, repr on the floats (what
        # json writes for a finite one), a fraction of what building a dict and dumping it
        # costs — every request pays it (tests/integration/test_logs.py holds the two to the same bytes).
        # ensure_ascii: no byte of the line can be read as a line break by any reader.
        fields = (json.dumps(redact_mapping(dict(sorted(record.fields.items()))), separators=(",", ":"))
                  if record.fields else "{}")
        line = (f'{{"ts":{_number(round(self._clock(), 6))},"request_id":{_text(record.request_id)},'
                f'"tenant":{_text(record.tenant)},"model":{_text(record.model)},"status":{_text(record.status)},'
                f'"latency_ms":{_number(record.latency_ms)},"layout":{_text(record.layout)},'
                f'"cached":{"true" if record.cached else "false"},"shadow":{"true" if record.shadow else "false"},'
                f'"fields":{fields}}}\n').encode("ascii")
        if len(line) > self.config.max_line_bytes:
            raise ValueError(
                f"record {record.request_id!r}: {len(line)} bytes as JSON, "
                f"above logs.max_line_bytes={self.config.max_line_bytes}; trim its fields"
            )
        return line

    def flush(self) -> int:
        """Write everything accepted so far; returns the number of lines in the file."""
        return self._writer.flush()

    def close(self) -> None:
        """Flush everything accepted and stop the flusher; safe to call more than once."""
        self._writer.close()

    @property
    def lines_on_disk(self) -> int:
        return self._writer.lines_on_disk

    @property
    def pending(self) -> int:
        return self._writer.pending

    @property
    def writes(self) -> int:
        return self._writer.writes

    def may_block(self, rpc: str, request: Any) -> bool:
        """Whether answering `rpc` to `request` may wait on the disk: `Flush` always (a write
        and its fsync); `AppendBatch` only when the ring has no room for its records (the
        writer's backpressure: it waits for the flusher, or writes itself). A caller serving
        from an event loop runs such a call on a thread, so the disk never stalls the loop."""
        if rpc == "Flush":
            return True
        if rpc == "AppendBatch":
            return len(request.records) > self._writer.room()
        return False

    # -- gRPC -----------------------------------------------------------------------------

    def append(self, items: Sequence[Any], options: CallOptions = NO_OPTIONS) -> list[ItemError | None]:
        """Encode every record and accept the good ones in one ring append; a record that cannot
        be a line is refused alone (INVALID_ARGUMENT naming its field). A closed or unwritable
        log fails the whole call (UNAVAILABLE): nothing of it was accepted. A record is a
        `LogEntry` or the `LogRecord` it encodes to (the same fields)."""
        results: list[ItemError | None] = []
        lines: list[bytes] = []
        for record in items:
            try:
                lines.append(self.encode(record))
                results.append(None)
            except ValueError as exc:
                results.append(ItemError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)))
        try:
            self._writer.append(lines)
        except (LogsClosedError, OSError) as exc:
            reason = ("the service is shutting down" if isinstance(exc, LogsClosedError)
                      else f"cannot write request log {self.path}")
            raise StatusError(grpc.StatusCode.UNAVAILABLE, f"{reason}: {exc}") from exc
        return results

    def AppendBatch(self, request: logs_pb2.AppendBatchRequest, context: Any = None) -> logs_pb2.AppendBatchResponse:
        """`append` over the wire."""
        return APPEND_BATCH.serve(self, request, context)

    def Flush(self, request: logs_pb2.FlushRequest, context: grpc.ServicerContext) -> logs_pb2.FlushResponse:
        try:
            return logs_pb2.FlushResponse(lines_written=self.flush())
        except OSError as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"cannot write request log {self.path}: {exc}")
        return logs_pb2.FlushResponse()  # not reached: abort raises


def _text(value: str) -> str:
    """A string value as json.dumps writes it (ASCII, escaped), secrets redacted first."""
    return encode_basestring_ascii(redact_text(value))


def _number(value: float) -> str:
    """A finite number as json.dumps writes it (a clock may tell the time in whole seconds)."""
    return float.__repr__(value) if type(value) is float else json.dumps(value)

