"""One upstream server: its connection pool, its health, its budget, and one attempt at it.

The pool is the upstream's `Transport` (`transports.py`: aiohttp for HTTP/1.1, httpx2 where
HTTP/2 may be negotiated), one per event loop that calls it. An attempt runs on an event
loop: the HTTP front's own, where the request came in over HTTP and is served there from
accept to answer, else the process's upstream loop (`loop.py`). It takes one of the
upstream's `max_connections` slots first (counted across loops) and gives it back in its
`finally`, so no path — an answer, an error, a hang cut off by its timeout, a
client that went away — keeps a slot. At the cap an attempt fails at once as BUSY (Envoy's
circuit breaker: fail fast, let a fallback answer) rather than queueing behind a slow upstream.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from services.common import ConfigError
from services.common.outlier import OutlierDetector, OutlierPolicy
from services.common.upstream_config import UpstreamSpec
from services.inference.upstream import translate
from services.inference.upstream.counters import EndpointCounters
from services.inference.upstream.failures import AttemptFailure, Kind, kind_for_status, retry_after_s
from services.inference.upstream.pieces import Pieces
from services.inference.upstream.protocols import (
    PROTOCOLS,
    Answer,
    Delta,
    Malformed,
    Relay,
    StreamError,
    error_message,
    is_context_length,
)
from services.inference.upstream.retry_budget import RetryBudget
from services.inference.upstream.token_count import TokenCounter
from services.inference.upstream.translate import Untranslatable
from services.inference.upstream.transports import LinkError, NoEvents, SSEParser, transport_for
from wire.v1 import generation_pb2

log = logging.getLogger("spine.upstream")

MAX_ERROR_BODY = 64 << 10  # an error answer is read this far for its message
MAX_ANSWER_BYTES = 16 << 20  # a whole answer larger than this is malformed (never read without a bound)
MAX_EVENT_BYTES = 1 << 20  # one server-sent event larger than this is malformed
REDACTED = "[redacted]"
EMBEDDINGS_PATH = "/embeddings"  # an OpenAI-protocol engine's embeddings, beside its chat completions
# Failures whose upstream words are the client's to read: the request itself was refused.
CLIENTS_OWN = frozenset({Kind.REFUSED, Kind.CONTEXT})
# What the client reads of the others: the class of the failure, never the upstream's words.
_CLASSES = {
    Kind.MISCONFIGURED: "the upstream refused the spine's credentials or model name; the operator's to fix",
    Kind.FAILED: "a server error",
    Kind.OVERLOADED: "overloaded",
}


def read_key(path: Path | None, where: str) -> str | None:
    """The key in `path` (its first line), read once at start; ConfigError when unusable."""
    if path is None:
        return None
    try:
        lines = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    except OSError as error:
        raise ConfigError(f"{where}.api_key_file: cannot read {path}: {error.strerror}") from None
    key = lines[0] if lines else ""
    if not key:
        raise ConfigError(f"{where}.api_key_file: {path} is empty")
    return key


class UpstreamEndpoint:
    """The upstream serving one router model, shared by every request to it."""

    def __init__(self, model_id: str, spec: UpstreamSpec, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.model_id = model_id
        self.spec = spec
        self.protocol = PROTOCOLS[spec.protocol]
        self.remote_model = spec.model or model_id
        self.url = spec.base_url + self.protocol.path
        key = read_key(spec.api_key_file, f"upstream of {model_id!r}")
        self._key = key
        self.headers = {"content-type": "application/json", "accept-encoding": "identity",
                        **self.protocol.headers(key)}
        self.outlier = OutlierDetector(f"upstream {model_id}", OutlierPolicy(
            spec.eject_after_failures, spec.ejection_s, spec.max_ejection_s), spec.timeout_s, clock)
        self.budget = RetryBudget(spec.retry_budget, spec.min_retries_per_s, clock=clock)
        self.in_flight = 0  # attempts holding a slot, on every loop that calls this upstream
        self._slots = threading.Lock()
        self.transport = transport_for(spec)
        self.counters = EndpointCounters()
        self.tokens = TokenCounter(spec.tokenizer_file, f"upstream of {model_id!r}")  # for answers without usage

    def __repr__(self) -> str:  # what a client's error message names: never the upstream's address
        return f"upstream {self.model_id}"

    # -- on the loop ------------------------------------------------------------------------
    def busy(self) -> AttemptFailure:
        return AttemptFailure(Kind.BUSY, f"{self!r} is at its cap of {self.spec.max_connections} requests at once "
                                         "(upstream.max_connections)")

    def _take_slot(self) -> None:
        with self._slots:  # two loops (two threads) may take slots at once
            if self.in_flight >= self.spec.max_connections:
                raise self.busy()
            self.in_flight += 1

    def _give_slot(self) -> None:
        with self._slots:
            self.in_flight -= 1

    async def unary(self, request: generation_pb2.GenerateRequest, timeout_s: float) -> Answer:
        """One attempt for a whole answer."""
        self._take_slot()
        try:
            body = self.protocol.body(request, self.remote_model, stream=False)
            url = self.spec.base_url + EMBEDDINGS_PATH if request.api == translate.EMBEDDINGS else self.url
            async with self.transport.post(url, self.headers, body, timeout_s) as reply:
                if reply.status != 200:
                    raise self._http_failure(reply.status, await reply.read(MAX_ERROR_BODY), reply.headers,
                                             embeddings=request.api == translate.EMBEDDINGS)
                raw = await reply.read(MAX_ANSWER_BYTES + 1)
            if len(raw) > MAX_ANSWER_BYTES:
                raise AttemptFailure(Kind.MALFORMED, f"{self!r} answered more than {MAX_ANSWER_BYTES} bytes", 200)
            return self.protocol.answer(raw, request)
        except Untranslatable as error:
            raise AttemptFailure(Kind.REFUSED, f"{self!r} cannot be sent this request: {error}") from None
        except Malformed as error:
            raise AttemptFailure(Kind.MALFORMED, f"{self!r} answered something unreadable", 200,
                                 detail=self.redact(str(error))) from None
        except LinkError as error:
            raise self._link_failure(error, timeout_s) from None
        finally:
            self._give_slot()

    async def stream(self, request: generation_pb2.GenerateRequest, timeout_s: float, pieces: Pieces) -> None:
        """One attempt for a stream: every Delta to `pieces` as it arrives (waiting for room:
        the upstream is read no faster than the client takes its pieces), then None at its
        end, or the AttemptFailure that ended it (after it, nothing is raised)."""
        put = pieces.end
        self._take_slot()
        try:
            body = self.protocol.body(request, self.remote_model, stream=True)
            async with self.transport.post(self.url, self.headers, body, timeout_s) as reply:
                if reply.status != 200:
                    raise self._http_failure(reply.status, await reply.read(MAX_ERROR_BODY), reply.headers)
                kind = reply.headers.get("content-type", "").partition(";")[0].strip().lower()
                if kind != "text/event-stream":
                    raise AttemptFailure(Kind.MALFORMED, f"{self!r} answered a stream request with {kind or 'no'} "
                                                         "content-type, not text/event-stream", 200)
                if not await self._relay(reply.pieces(), pieces, self.protocol.relay(request.api if request.body else "")):
                    raise AttemptFailure(Kind.UNREACHABLE, f"{self!r} closed the stream before its end", 200)
            put(None)
        except AttemptFailure as failure:
            put(failure)
        except Untranslatable as error:
            put(AttemptFailure(Kind.REFUSED, f"{self!r} cannot be sent this request: {error}"))
        except NoEvents as error:
            self.counters.no_events += 1
            put(AttemptFailure(Kind.MALFORMED, f"{self!r} {error}", 200))
        except (Malformed, ValueError) as error:
            put(AttemptFailure(Kind.MALFORMED, f"{self!r} sent an unreadable stream", 200,
                               detail=self.redact(str(error))))
        except StreamError as error:
            put(AttemptFailure(Kind.FAILED, f"{self!r} reported an error in its stream", 200,
                               detail=self.redact(str(error))))
        except LinkError as error:
            put(self._link_failure(error, timeout_s))
        except Exception as error:  # never leave the reader waiting: whatever broke is said
            log.exception("%r: the stream failed", self)
            put(AttemptFailure(Kind.FAILED, f"{self!r} failed ({type(error).__name__})",
                               detail=self.redact(str(error))))
        finally:
            self._give_slot()

    async def _relay(self, received: Any, pieces: Pieces, relay: Relay | None) -> bool:
        """Each event's Delta to `pieces` as its bytes arrive; whether the stream reached its end.
        The loop is given back after every read, so an upstream whose bytes are always ready
        (a fast one, or one sending garbage) takes its turn with the others, never the loop."""
        parser = SSEParser(MAX_EVENT_BYTES)
        async for piece in received:
            for name, data in parser.feed(piece):
                delta = self.protocol.event(name, data)
                events = relay(name, data) if relay is not None else []
                if delta is None and not events:
                    continue
                if delta is None:
                    delta = Delta()
                delta.events = events
                await pieces.put(delta)
                if delta.end:
                    return True
            await asyncio.sleep(0)
        return False

    def redact(self, text: str) -> str:
        """`text` without the spine's own key to this upstream (an engine may quote the
        Authorization header it got back, as OpenAI's 401 does)."""
        return text.replace(self._key, REDACTED) if self._key else text

    def _http_failure(self, status: int, raw: bytes, headers: Any, embeddings: bool = False) -> AttemptFailure:
        said = self.redact(error_message(raw))
        if embeddings and status in (404, 405):  # an engine with no embeddings for this model: the
            # client asked a generative model to embed; not the engine's fault, so not counted
            # towards ejecting it (a client could otherwise eject an engine with requests it cannot serve)
            return AttemptFailure(Kind.REFUSED, f"embeddings: {self!r} does not serve embeddings for its model "
                                                f"(its /embeddings answered {status}); ask a model that embeds",
                                  status, detail=said)
        kind = kind_for_status(status, said, is_context_length(said))
        wait = None
        if status == 429:
            ms = headers.get("retry-after-ms")
            wait = retry_after_s(headers.get("retry-after")) if ms is None else (retry_after_s(ms) or 0.0) / 1000.0
        if kind in CLIENTS_OWN:  # about the client's own request: its words are the client's to read
            return AttemptFailure(kind, f"{self!r} answered {status}: {said}", status, wait)
        detail = said
        if kind == Kind.MISCONFIGURED:
            detail += f" (check the upstream's api_key_file and model name {self.remote_model!r})"
        return AttemptFailure(kind, f"{self!r} answered {status} ({_CLASSES[kind]})", status, wait, detail)

    def _link_failure(self, error: LinkError, timeout_s: float) -> AttemptFailure:
        detail = self.redact(str(error))  # names the engine's address: the operator's
        if error.kind == Kind.TIMEOUT:
            return AttemptFailure(Kind.TIMEOUT, f"{self!r} did not answer within {timeout_s:.3g}s", detail=detail)
        if error.kind == Kind.MALFORMED:
            return AttemptFailure(Kind.MALFORMED, f"{self!r} answered something unreadable", detail=detail)
        return AttemptFailure(Kind.UNREACHABLE, f"{self!r} is unreachable", detail=detail)

    async def aclose(self) -> None:
        await self.transport.aclose()


__all__ = ["Answer", "Delta", "UpstreamEndpoint"]
