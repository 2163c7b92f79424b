"""A real PostgreSQL server for tests (`spine.tools.local_postgres`), one per session.

`make install` provides it (Debian's `postgresql` package, apt-get). Where it is missing
the tests that need it fail and say so: CI has apt-get, so a skip would only hide a broken
install. Each test takes a database of its own (`fresh_database`), so the session's
server is shared without one test seeing another's rows.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest

from spine.tools.local_postgres import LocalPostgres, PostgresError

_names = itertools.count(1)


def start_postgres() -> LocalPostgres:
    try:
        return LocalPostgres().start()
    except PostgresError as error:
        pytest.fail(f"{error}; these tests run a real PostgreSQL server and cannot do without one")


@pytest.fixture(scope="session")
def postgres() -> Iterator[LocalPostgres]:
    server = start_postgres()
    try:
        yield server
    finally:
        server.remove()


def fresh_database(server: LocalPostgres, prefix: str = "t") -> str:
    """A new empty database on `server`; its DSN (with the password: keep it out of logs)."""
    return server.create_database(f"{prefix}_{next(_names)}")
