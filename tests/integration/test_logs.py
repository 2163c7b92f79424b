"""Specification of the logs service: JSON lines, batched flushes, no loss, redaction."""

from __future__ import annotations

import json
import tempfile
import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest

from services.common import ConfigError
from services.common.redact import REDACTED, is_secret_key, redact_mapping, redact_text
from services.logs.config import LogsConfig
from services.logs.ring import LogRing, LogsClosedError
from services.logs.service import LogsService
from services.pipeline.batch_rpc import StatusError
from tests.batch_of_one import one
from tests.waiting import holds_within
from wire.v1 import logs_pb2, logs_pb2_grpc

JWT = (
    "eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9"
    ".eyJzdWIiOiIxMjM0NTY3ODkwIiwidGVuYW50IjoiZGV2In0"
    ".SflKxwRJSMeKKF2QT4fwpMeJf36POk6yJV_adQssw5c"
)


def rec(i: int = 0, **kw: Any) -> logs_pb2.LogRecord:
    base: dict[str, Any] = {
        "request_id": f"r{i}",
        "tenant": "dev",
        "model": "tiny-lm",
        "status": "OK",
        "latency_ms": 1.5,
        "layout": "collapsed",
    }
    base.update(kw)
    return logs_pb2.LogRecord(**base)


def append(service: LogsService, records: list[logs_pb2.LogRecord]) -> None:
    """AppendBatch in-process; a refused record raises ValueError naming its index."""
    answer = service.AppendBatch(logs_pb2.AppendBatchRequest(records=records))
    problems = [f"records[{i}].{status.message}" for i, status in enumerate(answer.results) if status.code]
    if problems:
        raise ValueError("; ".join(problems))


def config(tmp_path: Path, **kw: Any) -> LogsConfig:
    cfg: dict[str, Any] = {"path": "logs/requests.jsonl", "batch_lines": 64, "flush_interval_s": 3600.0}
    cfg.update(kw)
    return LogsConfig.parse(cfg, "logs")


def append_one(stub: Any, record: Any) -> None:
    one(stub.AppendBatch(logs_pb2.AppendBatchRequest(records=[record]), timeout=10))


def read_lines(path: Path) -> list[dict[str, Any]]:
    data = path.read_bytes() if path.exists() else b""
    assert data == b"" or data.endswith(b"\n")
    return [json.loads(line) for line in data.split(b"\n")[:-1]]


def wait_for_lines(path: Path, n: int, timeout_s: float = 10.0) -> list[dict[str, Any]]:
    """Poll until the file holds n lines (a generous deadline, not a timing assertion)."""
    holds_within(lambda: len(read_lines(path)) >= n, timeout_s)
    return read_lines(path)


@pytest.fixture
def service(tmp_path: Path) -> Iterator[LogsService]:
    svc = LogsService(config(tmp_path), run_dir=tmp_path, clock=lambda: 1700000000.25)
    yield svc
    svc.close()


def test_each_request_is_one_json_line_with_the_agreed_fields(service: LogsService) -> None:
    append(service,
        [rec(1, cached=True, shadow=True, status="UNAVAILABLE", fields={"route": "tiny-lm"})]
    )
    assert service.flush() == 1
    (line,) = read_lines(service.path)
    assert line == {
        "ts": 1700000000.25,
        "request_id": "r1",
        "tenant": "dev",
        "model": "tiny-lm",
        "status": "UNAVAILABLE",
        "latency_ms": 1.5,
        "layout": "collapsed",
        "cached": True,
        "shadow": True,
        "fields": {"route": "tiny-lm"},
    }


def test_path_is_relative_to_the_run_dir_and_config_errors_name_the_field(tmp_path: Path) -> None:
    assert config(tmp_path).path_in(tmp_path) == tmp_path / "logs" / "requests.jsonl"
    assert LogsConfig.parse({"path": "/var/log/x.jsonl"}).path_in(tmp_path) == Path("/var/log/x.jsonl")
    with pytest.raises(ConfigError, match=r"logs\.batch_lines: Input should be greater than or equal to 1, got 0"):
        LogsConfig.parse({"batch_lines": 0}, "logs")
    with pytest.raises(ConfigError, match=r"logs\.ring_capacity: must be >= logs\.batch_lines \(64\), got 8"):
        LogsConfig.parse({"ring_capacity": 8}, "logs")
    with pytest.raises(ConfigError, match=r"logs\.flush_interval_s: Input should be greater than 0"):
        LogsConfig.parse({"flush_interval_s": 0}, "logs")
    with pytest.raises(ConfigError, match=r"logs\.bach_lines: unknown key; known: path, batch_lines"):
        LogsConfig.parse({"bach_lines": 3}, "logs")


def test_a_full_batch_is_flushed_in_one_write(tmp_path: Path) -> None:
    svc = LogsService(config(tmp_path, batch_lines=5), run_dir=tmp_path)
    try:
        append(svc, [rec(i) for i in range(4)])
        append(svc, [rec(4)])
        lines = wait_for_lines(svc.path, 5)
        assert [line["request_id"] for line in lines] == [f"r{i}" for i in range(5)]
        assert svc.flush() == 5  # nothing pending: waits for the batch's write, writes nothing
        assert svc.writes == 1
        append(svc, [rec(5)])  # below batch_lines, and the interval is an hour away
        assert not holds_within(lambda: len(read_lines(svc.path)) > 5, 0.1), "a partial batch was written"
        assert len(read_lines(svc.path)) == 5
        assert svc.pending == 1
    finally:
        svc.close()


def test_a_partial_batch_is_flushed_when_the_interval_passes(tmp_path: Path) -> None:
    svc = LogsService(config(tmp_path, batch_lines=1000, ring_capacity=1000, flush_interval_s=0.02), run_dir=tmp_path)
    try:
        append(svc, [rec(i) for i in range(3)])
        assert len(wait_for_lines(svc.path, 3)) == 3
        assert svc.pending == 0
    finally:
        svc.close()


def test_close_writes_every_line_accepted_from_many_threads(tmp_path: Path) -> None:
    svc = LogsService(config(tmp_path, batch_lines=128, ring_capacity=512, flush_interval_s=0.05), run_dir=tmp_path)
    threads, per_thread = 8, 1250

    def worker(t: int) -> None:
        for i in range(0, per_thread, 10):
            append(svc, [rec(t * per_thread + i + j) for j in range(10)])

    workers = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    svc.close()
    svc.close()  # idempotent
    lines = read_lines(svc.path)
    assert len(lines) == threads * per_thread == 10_000
    assert sorted(int(line["request_id"][1:]) for line in lines) == list(range(10_000))
    assert svc.flush() == 10_000


def test_a_full_ring_blocks_then_flushes_without_dropping(tmp_path: Path) -> None:
    # A ring of 4 and batches of 10 and 7: every append meets a full ring at least once and
    # must wait for the flusher or flush in its own thread.
    svc = LogsService(config(tmp_path, batch_lines=4, ring_capacity=4, full_wait_s=0.001), run_dir=tmp_path)
    try:
        append(svc, [rec(i) for i in range(10)])  # more than the ring holds at once
        append(svc, [rec(10 + i) for i in range(7)])
        assert svc.flush() == 17
        assert [line["request_id"] for line in read_lines(svc.path)] == [f"r{i}" for i in range(17)]
    finally:
        svc.close()


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full to fail writes")
def test_a_failing_disk_pushes_back_instead_of_losing_or_hoarding_lines(tmp_path: Path) -> None:
    svc = LogsService(
        LogsConfig.parse(
            {
                "path": "/dev/full",
                "batch_lines": 4,
                "ring_capacity": 4,
                "flush_interval_s": 3600.0,
                "full_wait_s": 0.001,
            },
        ),
        run_dir=tmp_path,
    )
    try:
        append(svc, [rec(i) for i in range(4)])
        with pytest.raises(OSError):
            svc.flush()
        append(svc, [rec(4 + i) for i in range(4)])  # the ring has room again
        with pytest.raises(StatusError) as refused:
            append(svc, [rec(8)])  # ring full and the disk still fails: refused, as the wire would
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "cannot write request log /dev/full" in refused.value.details()
        assert svc.pending == 8  # the failed batch is kept for retry, nothing more is taken
        assert svc.lines_on_disk == 0
    finally:
        with pytest.raises(OSError):
            svc.close()


def test_lines_stay_in_order_of_acceptance(service: LogsService) -> None:
    for i in range(0, 300, 3):
        append(service, [rec(i), rec(i + 1), rec(i + 2)])
    service.close()
    assert [line["request_id"] for line in read_lines(service.path)] == [f"r{i}" for i in range(300)]


def test_secrets_in_fields_or_jwt_values_never_reach_the_file(service: LogsService) -> None:
    append(service,
        [
            rec(
                1,
                request_id=JWT,
                fields={
                    "Authorization": "Basic dXNlcjpwYXNz",
                    "x-api-key": "sk-live-123456",
                    "refresh_token": "opaque-refresh",
                    "note": f"client sent Bearer {JWT} and Bearer abc.def",
                    "upstream": JWT,
                    "max_tokens": "64",
                },
            )
        ]
    )
    service.close()
    raw = service.path.read_text()
    for secret in ("dXNlcjpwYXNz", "sk-live-123456", "opaque-refresh", "eyJ", "abc.def", "SflKxwRJ"):
        assert secret not in raw
    (line,) = read_lines(service.path)
    assert line["request_id"] == REDACTED
    assert line["fields"]["x-api-key"] == REDACTED
    assert line["fields"]["note"] == f"client sent {REDACTED} and {REDACTED}"
    assert line["fields"]["max_tokens"] == "64"


def test_redaction_rules() -> None:
    assert all(
        is_secret_key(k) for k in ("password", "apiKey", "X-Auth-Token", "client_secret", "Set-Cookie")
    )
    assert not any(is_secret_key(k) for k in ("max_tokens", "token_count", "tenant", "model", "status"))
    nested = {"headers": {"cookie": "a=b"}, "list": [{"Credentials": "x"}, "Bearer tok"], "n": 3}
    assert redact_mapping(nested) == {
        "headers": {"cookie": REDACTED},
        "list": [{"Credentials": REDACTED}, REDACTED],
        "n": 3,
    }
    assert redact_text(f"jwt={JWT};") == f"jwt={REDACTED};"
    # Dotted names that are not tokens survive.
    assert redact_text("api.example.com v1.2.3 tiny-lm") == "api.example.com v1.2.3 tiny-lm"


def test_a_bad_record_is_refused_alone_and_the_rest_of_its_batch_is_written(service: LogsService) -> None:
    with pytest.raises(ValueError, match=r"records\[1\]\.latency_ms"):
        append(service, [rec(0), rec(1, latency_ms=float("inf"))])
    with pytest.raises(ValueError, match=r"above logs\.max_line_bytes=65536"):
        append(service, [rec(2, fields={"big": "x" * 70_000})])
    assert service.flush() == 1
    assert [line["request_id"] for line in read_lines(service.path)] == ["r0"]


def test_append_after_close_is_refused_and_line_count_survives_restart(tmp_path: Path) -> None:
    svc = LogsService(config(tmp_path), run_dir=tmp_path)
    append(svc, [rec(0), rec(1)])
    svc.close()
    with pytest.raises(StatusError, match="shutting down") as refused:
        append(svc, [rec(2)])
    assert isinstance(refused.value.__cause__, LogsClosedError)
    again = LogsService(config(tmp_path), run_dir=tmp_path)
    try:
        append(again, [rec(2)])
        assert again.flush() == 3
    finally:
        again.close()


def test_ring_is_a_fifo_of_fixed_capacity() -> None:
    ring = LogRing(3)
    assert ring.put([b"a", b"b"]) == 2
    assert ring.drain() == [b"a", b"b"]
    assert ring.put([b"c", b"d", b"e", b"f"]) == 3  # wraps around the end
    assert ring.put([b"f"]) == 0
    assert len(ring) == 3
    assert ring.drain() == [b"c", b"d", b"e"]
    assert len(ring) == 0


def test_grpc_round_trip_on_a_unix_socket(service: LogsService) -> None:
    with tempfile.TemporaryDirectory(prefix="spl") as tmp:
        address = f"unix:{tmp}/logs.sock"
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        logs_pb2_grpc.add_LogsServicer_to_server(service, server)
        server.add_insecure_port(address)
        server.start()
        try:
            with grpc.insecure_channel(address) as channel:
                stub = logs_pb2_grpc.LogsStub(channel)
                append_one(stub, rec(1, fields={"password": "hunter2"}))
                append_one(stub, rec(2))
                with pytest.raises(grpc.RpcError) as err:
                    append_one(stub, rec(3, latency_ms=-1.0))
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "latency_ms" in (err.value.details() or "")
                assert stub.Flush(logs_pb2.FlushRequest(), timeout=10).lines_written == 2
        finally:
            server.stop(grace=None)
    lines = read_lines(service.path)
    assert [line["request_id"] for line in lines] == ["r1", "r2"]
    assert lines[0]["fields"] == {"password": REDACTED}


def test_text_too_short_to_hold_a_secret_skips_the_regex_and_nothing_shorter_matches() -> None:
    """`redact_text` keeps text under `_SHORTEST_SECRET` characters without running the
    regex; that is safe only if no shorter text can match — checked exhaustively over the
    characters the patterns are made of."""
    import itertools

    from services.common.redact import _SECRET_TEXT, _SHORTEST_SECRET, redact_text

    assert redact_text("eyJ.a.") == "[REDACTED]"  # the shortest match is still caught
    for length in range(1, _SHORTEST_SECRET):
        for chars in itertools.product("eyJbBr a.=-_", repeat=length):
            assert _SECRET_TEXT.search("".join(chars)) is None, chars


def test_the_quick_screen_never_keeps_text_the_patterns_would_redact() -> None:
    """`redact_text` skips the regex for text with neither a dot nor the word "bearer": it
    must give what the regex gives on every text, secrets in any case and spacing included."""
    import random

    from services.common.redact import _SECRET_TEXT, redact_text

    crafted = ["Bearer\ttok_123", "BEARER   abc", "x-bEaReR\nzzz", "eyJhbGci.eyJzdWIi.", "a" * 20 + "." + "b" * 20
               + "." + "c" * 20, "3f2a9c0d1e2b3c4d5e6f7a8b000000000012", "tiny-lm", "collapsed", "ｂearer tok"]
    rng = random.Random(7)
    alphabet = "eyJbearBEAR .\t\n=-_aZ09"
    crafted += ["".join(rng.choice(alphabet) for _ in range(rng.randint(6, 40))) for _ in range(20_000)]
    crafted += [rng.choice(["bearer ", "Bearer\t", "eyJ", "."]) + "".join(rng.choice(alphabet) for _ in range(30))
                for _ in range(2_000)]
    for text in crafted:
        assert redact_text(text) == _SECRET_TEXT.sub(REDACTED, text), text


def test_a_line_is_byte_for_byte_what_json_dumps_makes_of_the_record(tmp_path: Path) -> None:
    """`encode` assembles the line itself (every request pays for it); it must be exactly the
    bytes json.dumps writes for the same entry — escapes, non-ASCII, line separators, quotes,
    secrets, floats and a clock in whole seconds included."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    texts = st.one_of(st.text(max_size=40), st.sampled_from(["", "tiny-lm", JWT, "Bearer abc.def", 'a"b\\c',
                                                             "line\u2028break\n", "snowman \u2603 \U0001F600"]))
    clocks = st.one_of(st.floats(min_value=0, max_value=4e9, allow_nan=False), st.integers(0, 4_000_000_000))

    now_is = [0.0]
    service = LogsService(config(tmp_path, max_line_bytes=1 << 20), run_dir=tmp_path, clock=lambda: now_is[0])

    @settings(max_examples=300, deadline=None)
    @given(texts, texts, texts, texts, texts, st.floats(min_value=0, max_value=1e12, allow_nan=False,
                                                       allow_infinity=False),
           st.booleans(), st.booleans(), st.dictionaries(texts, texts, max_size=3), clocks)
    def check(request_id: str, tenant: str, model: str, status: str, layout: str, latency_ms: float,
              cached: bool, shadow: bool, fields: dict[str, str], now: float) -> None:
        now_is[0] = now
        record = logs_pb2.LogRecord(request_id=request_id, tenant=tenant, model=model, status=status,
                                    latency_ms=latency_ms, layout=layout, cached=cached, shadow=shadow, fields=fields)
        entry = {"ts": round(now, 6), "request_id": redact_text(request_id), "tenant": redact_text(tenant),
                 "model": redact_text(model), "status": redact_text(status), "latency_ms": record.latency_ms,
                 "layout": redact_text(layout), "cached": cached, "shadow": shadow,
                 "fields": redact_mapping(dict(sorted(record.fields.items())))}
        assert service.encode(record) == (json.dumps(entry, separators=(",", ":")) + "\n").encode("ascii")

    try:
        check()
    finally:
        service.close()
