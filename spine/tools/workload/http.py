"""A workload's requests sent over the HTTP API, as existing clients send them.

The demo sends part of its traffic this way so the migration's split, shadow comparisons
and gates cover HTTP as a real stack's traffic: a request of the workload becomes an OpenAI
chat completion or an Anthropic message (every other one), streamed where the workload
streams. Standard library only (http.client, one keep-alive connection per worker): the
demo's clients need nothing the server does not.
"""

from __future__ import annotations

import http.client
import json
import ssl
from collections.abc import Sequence

from runtime.config.sections import TlsConfig
from spine.tools.workload.generator import Item, closed_loop

FAILED = 0  # the status of a request that got no answer (connection refused or dropped)


def http_request(item: Item, index: int) -> tuple[str, bytes, dict[str, str]]:
    """(path, JSON body, headers) of one workload item: OpenAI chat for even indices,
    Anthropic messages for odd ones."""
    request = item.request
    headers = {"content-type": "application/json", **dict(item.headers)}
    messages = [{"role": "user", "content": request.prompt}]
    body: dict[str, object] = {"model": request.model, "max_tokens": request.max_tokens,
                               "temperature": request.temperature, "stream": item.stream, "messages": messages}
    if request.HasField("seed"):
        body["seed"] = request.seed
    if index % 2 == 0:
        if request.system:
            body["messages"] = [{"role": "system", "content": request.system}, *messages]
        if item.token:
            headers["authorization"] = f"Bearer {item.token}"
        return "/v1/chat/completions", json.dumps(body).encode(), headers
    if request.system:
        body["system"] = request.system
    if item.token:
        headers["x-api-key"] = item.token
    return "/v1/messages", json.dumps(body).encode(), headers


def _connection(address: str, tls: TlsConfig | None, timeout_s: float) -> http.client.HTTPConnection:
    host, _, port = address.rpartition(":")
    if tls is None:
        return http.client.HTTPConnection(host.strip("[]"), int(port), timeout=timeout_s)
    context = ssl.create_default_context(cafile=tls.server_ca_file)
    context.load_cert_chain(tls.cert_file, tls.key_file)
    return http.client.HTTPSConnection(host.strip("[]"), int(port), timeout=timeout_s, context=context)


def run_http_workload(address: str, items: Sequence[Item], *, concurrency: int = 2, time_limit_s: float = 60.0,
                      timeout_s: float = 10.0, tls: TlsConfig | None = None) -> list[int | None]:
    """Send `items` over HTTP to `address`; each one's status (FAILED: no answer), None when
    the time ran out before it was sent. A stream is read to its end."""
    statuses: list[int | None] = [None] * len(items)

    def send(worker: dict[str, http.client.HTTPConnection | None], index: int) -> None:
        path, body, headers = http_request(items[index], index)
        for attempt in range(2):  # a keep-alive connection the server closed meanwhile: once more
            connection = worker.get("connection")
            if connection is None:
                connection = worker["connection"] = _connection(address, tls, timeout_s)
            try:
                connection.request("POST", path, body=body, headers=headers)
                answer = connection.getresponse()
                answer.read()
                statuses[index] = answer.status
                if answer.getheader("connection", "").lower() == "close":
                    connection.close()
                    worker["connection"] = None
                return
            except (OSError, http.client.HTTPException):
                connection.close()
                worker["connection"] = None
                if attempt:
                    statuses[index] = FAILED

    workers: list[dict[str, http.client.HTTPConnection | None]] = [{} for _ in range(concurrency)]
    try:
        closed_loop(len(items), workers, send, time_limit_s)  # one keep-alive connection per worker
    finally:
        for connection in [worker.get("connection") for worker in workers]:
            if connection is not None:
                connection.close()
    return statuses
