"""The HTTP client libraries' per-request log lines, kept out of a server's log.

httpx (and its fork httpx2, which the HTTP front between a foreign gateway and the spine
uses) logs one INFO line per request it sends ("HTTP Request: POST … 200 OK"), httpcore one
DEBUG line per step of it. A controller proxying a few hundred requests a second at INFO
wrote almost nothing else: its own lines (transitions, gates, the dashboard's address) were
lost among them. What those lines said is already counted in the front's metrics; their
warnings and errors still come through.
"""

from __future__ import annotations

import logging

HTTP_CLIENT_LOGGERS = ("httpx", "httpx2", "httpcore", "httpcore2", "openai")


def quiet_http_clients(level: int = logging.WARNING) -> dict[str, int]:
    """Set the HTTP clients' loggers to `level`; their levels before, by name (to restore)."""
    before = {}
    for name in HTTP_CLIENT_LOGGERS:
        logger = logging.getLogger(name)
        before[name] = logger.level
        logger.setLevel(level)
    return before
