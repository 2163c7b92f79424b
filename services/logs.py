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

import grpc

from services.common import Clock, DeviceState, ReadHooks
from services.log_ring import BatchedLineWriter, LogsClosedError
from services.redact import redact_mapping
from services.sections import LogsConfig
from spine.v1 import logs_pb2, logs_pb2_grpc


class LogsService(logs_pb2_grpc.LogsServicer):
    """Writes request logs; `append_batch` is the batcher's one ring append per micro-batch."""

    def __init__(
        self, config: LogsConfig, device: DeviceState | None = None, clock: Clock = time.time
    ) -> None:
        self.config = config
        self.device = device
        self._clock = clock
        # Run before every flush and at close: lines handed over but not yet appended (the
        # spine's completions window) go in first.
        self.read_hooks = ReadHooks()
        self._writer = BatchedLineWriter(
            config.path,
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
        entry = {
            "ts": round(self._clock(), 6),
            "request_id": record.request_id,
            "tenant": record.tenant,
            "model": record.model,
            "status": record.status,
            "latency_ms": record.latency_ms,
            "layout": record.layout,
            "cached": record.cached,
            "shadow": record.shadow,
            "fields": dict(sorted(record.fields.items())),
        }
        # ensure_ascii: no byte of the line can be read as a line break by any reader.
        line = (json.dumps(redact_mapping(entry), separators=(",", ":")) + "\n").encode("ascii")
        if len(line) > self.config.max_line_bytes:
            raise ValueError(
                f"record {record.request_id!r}: {len(line)} bytes as JSON, "
                f"above logs.max_line_bytes={self.config.max_line_bytes}; trim its fields"
            )
        return line

    def append_batch(self, records: Sequence[logs_pb2.LogRecord]) -> None:
        """Encode all records, then accept them in one ring append (all or none if one is bad)."""
        lines = []
        for i, record in enumerate(records):
            try:
                lines.append(self.encode(record))
            except ValueError as exc:
                raise ValueError(f"records[{i}].{exc}") from None
        self._writer.append(lines)

    def flush(self) -> int:
        """Write everything accepted so far; returns the number of lines in the file."""
        self.read_hooks.run()
        return self._writer.flush()

    def close(self) -> None:
        """Flush everything accepted and stop the flusher; safe to call more than once."""
        self.read_hooks.run()
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

    # -- gRPC -----------------------------------------------------------------------------

    def Append(self, request: logs_pb2.LogRecord, context: grpc.ServicerContext) -> logs_pb2.AppendResponse:
        try:
            self.append_batch([request])
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc).removeprefix("records[0]."))
        except LogsClosedError as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"{exc}: the service is shutting down")
        except OSError as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"cannot write request log {self.config.path}: {exc}")
        return logs_pb2.AppendResponse()

    def Flush(self, request: logs_pb2.FlushRequest, context: grpc.ServicerContext) -> logs_pb2.FlushResponse:
        try:
            return logs_pb2.FlushResponse(lines_written=self.flush())
        except OSError as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"cannot write request log {self.config.path}: {exc}")
        return logs_pb2.FlushResponse()  # not reached: abort raises
