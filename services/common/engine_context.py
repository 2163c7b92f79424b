"""An upstream engine's context length, read from its own `GET /v1/models`.

An engine knows how long a sequence it serves: vLLM says `max_model_len` for each model,
llama.cpp's server `meta.n_ctx_train`, others `context_length`, `context_window` or
`max_context_length`. The gateway sizes a model's request limits from it
(`services.pipeline.limits.ModelSizes`), so a spine in front of a 128k engine does not refuse
a 3,000-token answer with the 256 of `limits.max_tokens`, which suits the built-in toy model.

Read off the request path, on a daemon thread per engine, until it answers (an engine that is
still starting is asked again); until then, and for an engine that reports none, the model
keeps `limits.*`. The key is the upstream's own (`api_key_file`), never logged.
"""

from __future__ import annotations

import json
import logging
import ssl
import threading
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("spine.limits")

# Fields an engine's model entry may carry its context length in, most specific first.
CONTEXT_FIELDS = ("max_model_len", "context_length", "context_window", "max_context_length", "max_seq_len")
RETRY_S = 30.0  # an engine that did not answer is asked again this often
TIMEOUT_S = 3.0
MAX_ANSWER_BYTES = 4 << 20


@dataclass(frozen=True)
class Engine:
    """Where to ask: the upstream's base URL (…/v1), the name it knows the model by, its key file
    and CA file; `anthropic`: its API lists no context lengths, so it is never asked."""

    base_url: str
    model: str
    api_key_file: Path | None = None
    ca_file: Path | None = None
    anthropic: bool = False


def context_in(listing: Any, model: str) -> int | None:
    """The context length `listing` (a `/v1/models` answer) gives `model`, or None."""
    entries = listing.get("data") if isinstance(listing, Mapping) else None
    if not isinstance(entries, list):
        return None
    named = [e for e in entries if isinstance(e, Mapping) and model in (e.get("id"), e.get("root"))]
    if not named and len(entries) == 1 and isinstance(entries[0], Mapping):
        named = [entries[0]]  # a server of one model, which it calls by its own name
    for entry in named:
        meta = entry.get("meta")
        for source in (entry, meta if isinstance(meta, Mapping) else {}):
            for field in (*CONTEXT_FIELDS, "n_ctx_train", "n_ctx"):
                value = source.get(field)
                if isinstance(value, int) and not isinstance(value, bool) and value >= 2:
                    return value
    return None


def read_context_length(engine: Engine, timeout_s: float = TIMEOUT_S) -> int | None:
    """Ask the engine once (OSError or ValueError when it cannot be asked or answers nonsense)."""
    headers = {"accept": "application/json"}
    if engine.api_key_file is not None:
        lines = [line.strip() for line in engine.api_key_file.read_text().splitlines() if line.strip()]
        if lines:
            headers["authorization"] = f"Bearer {lines[0]}"
    context = ssl.create_default_context(cafile=str(engine.ca_file)) if engine.ca_file else None
    # Straight to the engine, as the upstream's own client goes: no proxy from the environment.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=context))
    request = urllib.request.Request(engine.base_url.rstrip("/") + "/models", headers=headers)
    with opener.open(request, timeout=timeout_s) as answer:
        listing = json.loads(answer.read(MAX_ANSWER_BYTES))
    return context_in(listing, engine.model)


class EngineContexts:
    """The context lengths read from engines so far, each engine asked on a thread of its own."""

    def __init__(self, retry_s: float = RETRY_S) -> None:
        self._known: dict[Engine, int] = {}
        self._asking: set[Engine] = set()
        self._lock = threading.Lock()
        self._retry_s = retry_s
        self._stop = threading.Event()

    def get(self, engine: Engine) -> int | None:
        return self._known.get(engine)

    def ask(self, engine: Engine) -> None:
        """Start asking `engine` (once per engine; an anthropic-protocol engine is never asked)."""
        if engine.anthropic:
            return
        with self._lock:
            if engine in self._asking:
                return
            self._asking.add(engine)
        threading.Thread(target=self._ask_until_answered, args=(engine,), name="engine-context",
                         daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def _ask_until_answered(self, engine: Engine) -> None:
        said = False
        while not self._stop.is_set():
            try:
                length = read_context_length(engine)
            except (OSError, ValueError) as error:
                if not said:  # once: an engine that is starting is asked again quietly
                    log.info("upstream model %s: its context length is not known yet (%s); its requests keep "
                             "limits.max_tokens and limits.max_prompt_chars until it answers",
                             engine.model, type(error).__name__)
                    said = True
            else:
                if length is None:
                    log.info("upstream model %s: its engine reports no context length; set the route's "
                             "context_length to size its limits", engine.model)
                    return
                self._known[engine] = length
                log.info("upstream model %s: context length %d, from its engine", engine.model, length)
                return
            self._stop.wait(self._retry_s)
