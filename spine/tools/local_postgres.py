"""A throwaway PostgreSQL server on loopback, for the tests and the rehearsal.

The controllers' shared state store (`migration.state_store`, several `spine controller`
replicas electing a leader) can be PostgreSQL; a test starts its own from Debian's
`postgresql` package (`make install`): `initdb` into a fresh data directory, `postgres` with
its unix socket in that directory and TCP on 127.0.0.1 on a free port, a password for the
one role (scram), and stops it by its PID.

PostgreSQL refuses to run as root: as root, both run as the `postgres` user the package
creates (the data directory is made theirs) through `setpriv`, which changes user and execs,
so the server's PID is the one we started and stop (`runuser` would stay as its parent). No
Python code runs between fork and exec either (no `preexec_fn`, no `user=`): in a process
that already runs gRPC, its fork handlers must not run in the child. `restart` is the same cluster stopped (fast shutdown) and started again on the same
port: a store that goes away and comes back with everything it committed.
"""

from __future__ import annotations

import glob
import os
import pwd
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from runtime.server import free_port

READY_TIMEOUT_S = 30.0
ROLE = "spine"
DATABASE = "spine"


class PostgresError(RuntimeError):
    pass


def postgres_bin(name: str) -> str:
    """`initdb` or `postgres`: on PATH, else where Debian keeps them (/usr/lib/postgresql/VER/bin)."""
    found = shutil.which(name)
    if found:
        return found
    candidates = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    if not candidates:
        raise PostgresError(f"{name} is not installed: `make install` installs it (Debian package `postgresql`, "
                            "apt-get)")
    return candidates[-1]


class LocalPostgres:
    """A PostgreSQL cluster in a temporary directory, on 127.0.0.1:`port` (a free one)."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.password = secrets.token_urlsafe(16)
        # Not under the caller's tmp_path: that is often root's and mode 700, which the
        # postgres user could not enter.
        self.workdir = Path(tempfile.mkdtemp(prefix="spine-postgres-"))
        self.data = self.workdir / "data"
        self.log = self.workdir / "postgres.log"
        self.process: subprocess.Popen[bytes] | None = None
        self._as: list[str] = []  # the command prefix that runs as the postgres user (as root)
        self._owner: tuple[int, int] | None = None
        if os.geteuid() == 0:
            user = pwd.getpwnam("postgres")
            self._owner = (user.pw_uid, user.pw_gid)
            os.chown(self.workdir, *self._owner)
            setpriv = shutil.which("setpriv")
            if setpriv is None:
                raise PostgresError("running as root needs setpriv (util-linux) to start PostgreSQL as the "
                                    "postgres user")
            self._as = [setpriv, f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups"]

    @property
    def dsn(self) -> str:
        """A libpq URI (it carries the password: never log it; `describe` is what to print)."""
        return f"postgresql://{ROLE}:{self.password}@127.0.0.1:{self.port}/{DATABASE}"

    def describe(self) -> str:
        return f"postgresql://{ROLE}@127.0.0.1:{self.port}/{DATABASE}"

    def start(self) -> LocalPostgres:
        if not self.data.exists():
            self._initdb()
        self._launch()
        return self

    def _initdb(self) -> None:
        pwfile = self.workdir / "pwfile"
        pwfile.write_text(self.password + "\n")
        if self._owner is not None:
            os.chown(pwfile, *self._owner)
        pwfile.chmod(0o600)
        try:
            subprocess.run([*self._as, postgres_bin("initdb"), "-D", str(self.data), "-U", ROLE, f"--pwfile={pwfile}",
                            "--auth=scram-sha-256", "-E", "UTF8", "--no-instructions", "--no-sync"],
                           check=True, capture_output=True, stdin=subprocess.DEVNULL, cwd=self.workdir)
        except subprocess.CalledProcessError as error:
            raise PostgresError(f"initdb failed: {error.stderr.decode(errors='replace')[-2000:]}") from None
        finally:
            pwfile.unlink(missing_ok=True)

    def _launch(self) -> None:
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(
                [*self._as, postgres_bin("postgres"), "-D", str(self.data), "-p", str(self.port), "-k", str(self.workdir),
                 "-c", "listen_addresses=127.0.0.1", "-c", "max_connections=50",
                 # Thrown away after the run: what it stands for is a server that stops and
                 # starts (committed work kept by its shutdown checkpoint), not a power cut.
                 "-c", "fsync=off", "-c", "full_page_writes=off"],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=self.workdir,
                start_new_session=True)
        self._wait_ready()
        self._ensure_database()

    def _connect(self, database: str) -> Any:
        import psycopg

        return psycopg.connect(host="127.0.0.1", port=self.port, user=ROLE, password=self.password,
                               dbname=database, connect_timeout=2, autocommit=True)

    def _wait_ready(self) -> None:
        import psycopg

        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            try:
                self._connect("postgres").close()
                return
            except psycopg.OperationalError:
                pass
            assert self.process is not None
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise PostgresError(f"postgres on 127.0.0.1:{self.port} did not start; its log ({self.log}):\n"
                                    f"{self.log.read_text(errors='replace')[-2000:]}")
            time.sleep(0.05)

    def _ensure_database(self) -> None:
        with self._connect("postgres") as conn:
            if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (DATABASE,)).fetchone() is None:
                conn.execute(f"CREATE DATABASE {DATABASE}")

    def create_database(self, name: str) -> str:
        """A fresh, empty database `name` (letters, digits, _) on this server; its DSN."""
        if not name.replace("_", "").isalnum():
            raise ValueError(f"database name {name!r}: letters, digits and _ only")
        with self._connect("postgres") as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {name}")
            conn.execute(f"CREATE DATABASE {name}")
        return self.dsn.rsplit("/", 1)[0] + f"/{name}"

    def stop(self) -> None:
        """Fast shutdown (SIGINT: running transactions are rolled back, committed ones kept)."""
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        os.kill(process.pid, signal.SIGCONT)
        os.kill(process.pid, signal.SIGINT)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)

    def restart(self) -> None:
        self.stop()
        self._launch()

    def remove(self) -> None:
        """Stop it and delete its files."""
        self.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> LocalPostgres:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.remove()
