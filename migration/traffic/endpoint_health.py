"""Each side's gateways, watched by their health, steer the traffic split.

A gateway is SERVING only while every fail-closed component behind it is
(`runtime.health.gateway`), so its health is the truth about whether it can answer.
`EndpointHealth` asks every endpoint of both sides every `interval_s` (all at once, each
within `timeout_s`) and, on each change, tells

* the built-in front (`Front.healthy`, per side: healthy while any endpoint is): a request
  meant for a side that is not serving goes to the other one and counts as a failure of
  its side, so the gates see it and roll back while no client does;
* the xDS control plane: each endpoint is sent HEALTHY or UNHEALTHY, so Envoy and proxyless
  clients stop picking it.

With the defaults a side that says NOT_SERVING loses its traffic within 0.5 s plus one
answer; a side that does not answer at all, within 1.5 s.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from migration.xds import Endpoint, XdsControlPlane
from runtime.config.sections import TlsConfig
from runtime.health.watch import HealthWatch


class Steerable(Protocol):
    """A front that sends a request meant for an unhealthy side to the other."""

    def set_healthy(self, healthy: dict[str, bool]) -> None: ...


class EndpointHealth:
    """Watches `endpoints` (side -> gateway addresses, HOST:PORT) and steers the front and xDS."""

    def __init__(self, endpoints: Mapping[str, Sequence[str]], *, front: Steerable | None = None,
                 xds: XdsControlPlane | None = None, interval_s: float = 0.5, timeout_s: float = 0.5,
                 tls: TlsConfig | None = None) -> None:
        self.front = front
        self.xds = xds
        self.endpoints = {side: list(addresses) for side, addresses in endpoints.items()}
        self._keys = {f"{side} {address}": (side, address)
                      for side, addresses in self.endpoints.items() for address in addresses}
        self.watch = HealthWatch({key: address for key, (_, address) in self._keys.items()},
                                 interval_s=interval_s, timeout_s=timeout_s, on_change=self._steer,
                                 what="gateway", tls=tls)

    @property
    def healthy(self) -> dict[str, bool]:
        """Per side: True while any of its endpoints is SERVING (as last seen)."""
        return self._sides(self.watch.serving)

    def start(self) -> EndpointHealth:
        self.watch.start()
        return self

    def check_once(self) -> dict[str, bool]:
        """One round now (the watcher does one every interval); the sides' health."""
        return self._sides(self.watch.check_once())

    def stop(self) -> None:
        self.watch.stop()

    def _sides(self, serving: Mapping[str, bool]) -> dict[str, bool]:
        return {side: any(serving.get(f"{side} {address}", True) for address in addresses)
                for side, addresses in self.endpoints.items()}

    def _steer(self, serving: dict[str, bool]) -> None:
        if self.front is not None:
            self.front.set_healthy(self._sides(serving))
        if self.xds is not None:
            self.xds.set_endpoints({side: [endpoint(address, serving.get(f"{side} {address}", True))
                                           for address in addresses]
                                    for side, addresses in self.endpoints.items()})


def endpoint(address: str, healthy: bool = True) -> Endpoint:
    """An xDS endpoint from HOST:PORT."""
    host, _, port = address.rpartition(":")
    return Endpoint(host, int(port), healthy)
