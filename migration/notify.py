"""Webhook notifications: every committed transition POSTed as JSON, signed, retried, never in the way.

Flagger posts every step of a canary to a webhook; a team watching a cutover learns of a
rollback from its chat channel instead of by polling. Each transition the controller
commits (`Controller.on_transition`) is queued here and sent from a thread of its own, so a
receiver that is slow, down or hanging never holds the controller's lock: the controller
only puts the event on a bounded queue (a full queue drops it, counted and logged).

The body is JSON: `plan`, `stage`, `from_state`, `to_state`, `action`, `actor`, `reason`,
`spine_weight`, `version`, `audit_id`, `ts` and `gates` (the stage's latest window: gate,
verdict, value, threshold, dry_run, message). It is signed with HMAC-SHA256 of the exact
bytes sent, keyed by the configured secret: `X-Spine-Signature-256: sha256=<hex>` (the form
GitHub's webhooks use, so existing receivers verify it as they are). The receiver should
compare in constant time, and may drop an `audit_id` it has seen (a retry after a lost
answer delivers twice). A delivery is retried with exponential backoff (`backoff_s`
doubling up to `max_backoff_s`, `attempts` in all) on a connection error, a timeout or a
non-2xx answer; then it is given up, logged (the URL's host only: a path may hold a key)
and counted, and the next event goes.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import queue
import threading
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import asdict, dataclass
from typing import Any

from migration.status import TransitionEvent

log = logging.getLogger("spine.migration.notify")
SIGNATURE_HEADER = "X-Spine-Signature-256"
RESULTS = ("delivered", "retried", "failed", "dropped")


@dataclass(frozen=True)
class WebhookConfig:
    """One receiver. `secret` keys the signature; it is never logged."""

    url: str
    secret: str
    timeout_s: float = 5.0
    attempts: int = 5
    backoff_s: float = 0.5
    max_backoff_s: float = 30.0
    queue_size: int = 1000

    def __post_init__(self) -> None:
        parts = urllib.parse.urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"--webhook-url {self.endpoint}: expected http(s)://HOST[:PORT]/PATH")
        if not self.secret:
            raise ValueError("--webhook-secret-file: the webhook secret is empty")
        for name in ("timeout_s", "backoff_s", "max_backoff_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"webhook {name}: must be greater than 0, got {getattr(self, name)}")
        if self.attempts < 1 or self.queue_size < 1:
            raise ValueError("webhook attempts and queue_size: must be at least 1")

    @property
    def endpoint(self) -> str:
        """scheme://host:port only: what logs and metric labels name (a path may hold a key)."""
        parts = urllib.parse.urlsplit(self.url)
        return f"{parts.scheme}://{parts.hostname or ''}" + (f":{parts.port}" if parts.port else "")


def sign(secret: str, body: bytes) -> str:
    """The signature header's value for `body`."""
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def verify(secret: str, body: bytes, header: str) -> bool:
    """What a receiver does: the header matches the body, compared in constant time."""
    return hmac.compare_digest(sign(secret, body), header)


def event_body(event: TransitionEvent) -> bytes:
    payload: dict[str, Any] = asdict(event)
    payload["gates"] = [{key: gate[key] for key in ("gate", "verdict", "value", "threshold", "dry_run", "message",
                                                    "window_start", "window_end")}
                        for gate in payload["gates"]]
    return json.dumps(payload, sort_keys=True).encode()


class WebhookNotifier:
    """Delivers transitions to one receiver from a daemon thread; call it with each event."""

    def __init__(self, config: WebhookConfig) -> None:
        self.config = config
        self._queue: queue.Queue[bytes | None] = queue.Queue(maxsize=config.queue_size)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.counts = dict.fromkeys(RESULTS, 0)
        self._thread = threading.Thread(target=self._run, name="migration-webhook", daemon=True)
        self._thread.start()

    def __call__(self, event: TransitionEvent) -> None:
        """Queue `event`; never waits (a full queue drops it: counted, logged)."""
        try:
            self._queue.put_nowait(event_body(event))
        except queue.Full:
            self._count("dropped")
            log.warning("webhook %s: %d deliveries queued already; dropped the %s → %s transition",
                        self.config.endpoint, self.config.queue_size, event.from_state, event.to_state)

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop retrying and end the thread (what is queued is not delivered)."""
        self._stop.set()
        try:
            self._queue.put_nowait(None)
        except queue.Full:
            pass
        self._thread.join(timeout_s)

    def _count(self, result: str) -> None:
        with self._lock:
            self.counts[result] += 1

    def _run(self) -> None:
        while not self._stop.is_set():
            body = self._queue.get()
            if body is None:
                return
            self._deliver(body)

    def _deliver(self, body: bytes) -> None:
        config, delay = self.config, self.config.backoff_s
        for attempt in range(1, config.attempts + 1):
            problem = self._post(body)
            if problem is None:
                self._count("delivered")
                return
            if attempt == config.attempts or self._stop.is_set():
                self._count("failed")
                log.warning("webhook %s: gave up after %d attempt(s): %s", config.endpoint, attempt, problem)
                return
            self._count("retried")
            log.info("webhook %s: attempt %d failed (%s); retrying in %.1fs", config.endpoint, attempt, problem,
                     delay)
            if self._stop.wait(delay):
                self._count("failed")
                return
            delay = min(delay * 2, config.max_backoff_s)

    def _post(self, body: bytes) -> str | None:
        """None when the receiver answered 2xx, else what went wrong (no secret, no path)."""
        request = urllib.request.Request(self.config.url, data=body, method="POST", headers={
            "Content-Type": "application/json", SIGNATURE_HEADER: sign(self.config.secret, body),
            "User-Agent": "spine-migration-controller"})
        try:
            with urllib.request.urlopen(request, timeout=self.config.timeout_s) as answer:
                answer.read(65536)
                return None
        except urllib.error.HTTPError as error:
            return f"answered {error.code}"
        except (urllib.error.URLError, OSError) as error:
            reason = getattr(error, "reason", error)
            return f"{type(reason).__name__}: {reason}"
