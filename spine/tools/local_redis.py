"""A throwaway Redis server on loopback, for the tests and the lease bench.

The rate limiter's shared lease store (`ratelimit.store.redis`, `services.ratelimit.leases`)
is Redis; a test or bench starts its own `redis-server` (the Debian package, `make
install`) on a free loopback port, nothing persisted, and stops it by its PID. `stop` and
`start` again on the same port is a store restarted empty; `pause` (SIGSTOP) is a store that
still accepts connections but does not answer: a slow or partitioned store. `CuttableLink`
cuts one replica off the store while the others still reach it.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

from runtime.server import free_port

READY_TIMEOUT_S = 10.0


class LocalRedis:
    """`redis-server` on 127.0.0.1:`port` (a free one by default), its files under `workdir`."""

    def __init__(self, workdir: Path, port: int | None = None) -> None:
        self.workdir = Path(workdir)
        self.port = port or free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> LocalRedis:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not on PATH: `make test` installs it (Debian package "
                               "`redis-server`, apt-get)")
        self.workdir.mkdir(parents=True, exist_ok=True)
        log = open(self.workdir / "redis.log", "ab")  # noqa: SIM115 - the child holds it
        self.process = subprocess.Popen(
            [binary, "--bind", "127.0.0.1", "--port", str(self.port), "--save", "", "--appendonly", "no",
             "--dir", str(self.workdir), "--protected-mode", "yes", "--daemonize", "no"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        import redis

        deadline = time.monotonic() + READY_TIMEOUT_S
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=0.5, socket_connect_timeout=0.5)
        try:
            while True:
                try:
                    if client.ping():
                        return
                except (redis.RedisError, OSError):
                    pass
                assert self.process is not None
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server on {self.address} did not start; see {self.workdir / 'redis.log'}")
                time.sleep(0.02)
        finally:
            client.close()

    def stop(self) -> None:
        """Kill it (SIGKILL: nothing is saved anyway) and reap it."""
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGCONT)
            self.process.kill()
            self.process.wait(timeout=10)
        self.process = None

    def pause(self) -> None:
        """Stop answering (SIGSTOP): connections hang until `resume`."""
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGCONT)

    def __enter__(self) -> LocalRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class CuttableLink:
    """A TCP forwarder on loopback in front of the store, for one replica: `cut()` drops its
    connections and refuses new ones (that replica is partitioned from the store, the others
    are not); `mend()` lets it through again."""

    def __init__(self, target_port: int) -> None:
        self._target = ("127.0.0.1", target_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self._open = True
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, name="link-accept", daemon=True).start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if not self._open:
                client.close()
                continue
            try:
                upstream = socket.create_connection(self._target, timeout=1.0)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                self._sockets += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=_pump, args=(a, b), name="link-pump", daemon=True).start()

    def cut(self) -> None:
        self._open = False
        with self._lock:
            for sock in self._sockets:
                sock.close()
            self._sockets.clear()

    def mend(self) -> None:
        self._open = True

    def close(self) -> None:
        self.cut()
        self._listener.close()


def _pump(source: socket.socket, sink: socket.socket) -> None:
    try:
        while data := source.recv(65536):
            sink.sendall(data)
    except OSError:
        pass
    finally:
        for sock in (source, sink):
            try:
                sock.close()
            except OSError:
                pass
