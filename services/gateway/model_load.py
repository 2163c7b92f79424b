"""The gateway's view of each model's load: its latest `x-spine-load` hint.

Every answer that called the model carries the model's own hint. The others — a cache
hit, a refusal before the model (rate limited, unauthenticated, bad input), a model that
failed without one — get the latest hint the gateway has for the model the request named,
so a client always sees one (and a missing hint never reads as "calm"). The same hints
give the device's busy figure the rate-limit step sends with its ask (`busy`).

Hints come from the model's answers (`note`) and, once they have gone stale (nothing
answered for `refresh_s`: all traffic hit the cache, or only long streams are running),
from the inference component's `Models` rpc, which lists every model with its hint. That
call is made by the first request that finds them stale (others go on with what is there),
at most once per `refresh_s`: in the spine a method call, in the layered stack one small
rpc per half second at most, and none while answers keep the hints fresh.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from services.inference.api import Inference
from services.inference.load_hints import LOAD_HEADER, busy_figure, parse_load
from services.pipeline.interface import CallOptions
from wire.v1 import inference_pb2

log = logging.getLogger("spine.gateway")

REFRESH_S = 0.5  # a hint older than this is refreshed when asked for
STALE_S = 1.0  # a hint older than this says nothing about the busy figure any more
# A model's busy figure is read from its hint at most this often. The figure moves in the
# model's own 100 ms slots (`services.inference.load_hints.BusyMeter`), and parsing every
# answer's hint cost the spine CPU on every request for the same number most of the time.
FIGURE_EVERY_S = 0.02

Fetch = Callable[[], Iterable[tuple[str, str]]]  # every model's (id, hint), from the inference component


class ModelLoads:
    """The latest hint of every model, refreshed while they are asked for."""

    def __init__(self, fetch: Fetch | None = None, *, refresh_s: float = REFRESH_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._fetch = fetch
        self.refresh_s = refresh_s
        self._clock = clock
        self._hints: dict[str, tuple[str, float, float | None]] = {}  # id -> (hint, seen at, busy figure)
        self._figured: dict[str, float] = {}  # id -> when its busy figure was last read from a hint
        self._first = ""  # the model the inference component lists first (its default)
        self._names: dict[str, str] = {}  # a requested name (an alias) -> the model id it routed to
        self._fetching = threading.Lock()
        self._fetched_at = -1e18

    # -- what answers teach ---------------------------------------------------------------
    def note(self, model: str, hint: str) -> None:
        if model and hint:
            now = self._clock()
            known = self._hints.get(model)
            if known is not None and now - self._figured.get(model, -1e18) < FIGURE_EVERY_S:
                self._hints[model] = (hint, now, known[2])
                return
            self._hints[model] = (hint, now, busy_figure(parse_load(hint)))
            self._figured[model] = now

    def note_trailers(self, model: str, trailing: Iterable[tuple[str, Any]]) -> None:
        for key, value in trailing:
            if key == LOAD_HEADER:
                self.note(model, str(value))

    def learn(self, name: str, model: str) -> None:
        """`name` (an id or alias a client sent) routed to `model`."""
        if name and model and name != model and self._names.get(name) != model:
            self._names[name] = model

    def routed(self, name: str) -> str:
        """The model id `name` last routed to (`name` itself when this gateway has not seen it routed)."""
        return self._names.get(name, name)

    # -- what answers get -----------------------------------------------------------------
    def hint(self, name: str) -> str | None:
        """The latest hint of the model `name` routes to (as far as this gateway has seen);
        of the first model when it has not seen `name` routed."""
        self._keep_fresh()
        if not self._hints:
            self._fetch_now()
        model = self._names.get(name, name)
        entry = self._hints.get(model) or self._hints.get(self._first)
        return entry[0] if entry is not None else None

    def busy(self) -> float:
        """The device's busy fraction (0..1) by the freshest hints: the highest of the models'
        (they share the device); 0 when none is recent."""
        self._keep_fresh()
        now = self._clock()
        figures = [figure for _, seen, figure in list(self._hints.values())
                   if figure is not None and now - seen <= STALE_S]
        return max(figures, default=0.0)

    # -- refreshing -----------------------------------------------------------------------
    def _keep_fresh(self) -> None:
        now = self._clock()
        if self._fetch is None or now - self._fetched_at < self.refresh_s:
            return
        if self._hints and all(now - seen < self.refresh_s for _, seen, _ in list(self._hints.values())):
            return
        if self._fetching.acquire(blocking=False):  # one request refreshes; the others do not wait
            try:
                self._fetch_locked()
            finally:
                self._fetching.release()

    def _fetch_now(self) -> None:
        """Ask now (waiting for a fetch under way): when there is no hint at all."""
        with self._fetching:
            self._fetch_locked()

    def _fetch_locked(self) -> None:
        now = self._clock()
        if self._fetch is None or now - self._fetched_at < self.refresh_s:
            return
        self._fetched_at = now
        try:
            hints = list(self._fetch())
        except Exception as error:  # the model is down or slow: the answers say so themselves
            log.debug("could not refresh the models' load hints: %r", error)
            return
        for model, hint in hints:
            self.note(model, hint)
        if hints:
            self._first = hints[0][0]


MODELS_TIMEOUT_S = 0.25  # the refresh of the models' hints (a request waits for it)


def models_load(inference: Inference) -> list[tuple[str, str]]:
    """Every model's hint now, from the inference component (`ModelLoads`' refresh)."""
    answer = inference.models(inference_pb2.ModelInfoRequest(), CallOptions(timeout=MODELS_TIMEOUT_S))
    return [(model.id, model.load) for model in answer.models if model.load]
