"""A local HTTP receiver for the controller's webhooks (`migration.notify`), on loopback."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class Receiver:
    """A local HTTP receiver: records every POST; `answers` says what to reply, in order
    (then 200); with `hold` set, each request waits on it before answering (a hanging receiver)."""

    def __init__(self, answers: tuple[int, ...] = (), hold: threading.Event | None = None) -> None:
        self.received: list[tuple[dict[str, str], bytes]] = []
        self.arrived = threading.Condition()
        self.answers = list(answers)
        self.hold = hold
        self.holding = threading.Event()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                with receiver.arrived:
                    receiver.received.append((dict(self.headers), body))
                    receiver.arrived.notify_all()
                if receiver.hold is not None:
                    receiver.holding.set()
                    receiver.hold.wait(30)
                code = receiver.answers.pop(0) if receiver.answers else 200
                try:
                    self.send_response(code)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                except OSError:
                    pass  # the notifier gave up on this one already

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hooks/spine?key=path-secret"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def wait_for(self, count: int, timeout: float = 20.0) -> list[tuple[dict[str, str], bytes]]:
        with self.arrived:
            self.arrived.wait_for(lambda: len(self.received) >= count, timeout)
            return list(self.received)

    def stop(self) -> None:
        if self.hold is not None:
            self.hold.set()
        self.server.shutdown()
        self.server.server_close()
