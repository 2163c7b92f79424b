"""A link to a Redis server shared by replicas: its config block and the client it opens.

The rate limiter's lease store, the spend ledger and the key store each talk to a Redis the
replicas share. They read the same block (`address`, `key_prefix`, `password_file`,
`timeout_s`) and open the same kind of client: short timeouts and no retries inside a call
(the caller's next round retries), so a slow store costs a bounded wait, never a hung request.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from pydantic import Field

from services.common.config_section import Float, NonEmptyStr, Section


class RedisLink(Section):
    """Where a shared Redis is. `address` is HOST:PORT or unix:/PATH; every key starts with
    `key_prefix`. The password, when there is one, is read from a file, so it is never in a
    config or a log."""

    address: NonEmptyStr
    key_prefix: NonEmptyStr = "spine:"
    password_file: Path | None = None
    # A call slower than this counts as a failure: a slow store must not hold anything back.
    timeout_s: Annotated[Float, Field(gt=0)] = 0.25


def connect(link: RedisLink, timeout_s: float | None = None) -> Any:
    """A `redis.Redis` client for `link` (imported lazily: a process without a store never needs it)."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    timeout = link.timeout_s if timeout_s is None else timeout_s
    password = link.password_file.read_text().strip() if link.password_file else None
    common: dict[str, Any] = {"socket_timeout": timeout, "socket_connect_timeout": timeout,
                              "password": password, "retry": Retry(NoBackoff(), 0)}
    if link.address.startswith("unix:"):
        return redis.Redis(unix_socket_path=link.address[len("unix:"):], **common)
    host, _, port = link.address.rpartition(":")
    return redis.Redis(host=host.strip("[]") or "127.0.0.1", port=int(port), **common)
