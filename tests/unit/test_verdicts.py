"""The one table of verdicts: what a component's failure looks like to the client."""

from __future__ import annotations

import grpc

from services.pipeline.verdicts import downstream_stop


def test_a_components_own_verdict_passes_through_as_it_is() -> None:
    stop = downstream_stop("auth", grpc.StatusCode.UNAUTHENTICATED, "unknown API key",
                           passes={grpc.StatusCode.UNAUTHENTICATED})
    assert (stop.code, stop.details) == (grpc.StatusCode.UNAUTHENTICATED, "unknown API key")


def test_any_other_failure_is_unavailable_naming_the_component_but_never_an_internal_address() -> None:
    for details in ("failed to connect to all addresses; last error: UNKNOWN: unix:/tmp/spine-x/run/auth.sock: "
                    "Connection refused",
                    "failed to connect to all addresses; last error: UNAVAILABLE: ipv4:127.0.0.1:40123: "
                    "Failed to connect to remote host: Connection refused"):
        stop = downstream_stop("auth", grpc.StatusCode.UNAVAILABLE, details,
                               passes={grpc.StatusCode.UNAUTHENTICATED})
        assert stop.code == grpc.StatusCode.UNAVAILABLE
        assert stop.details.startswith("auth unavailable (UNAVAILABLE: failed to connect to all addresses")
        assert "<internal address>" in stop.details
        assert all(secret not in stop.details for secret in ("unix:", ".sock", "127.0.0.1", "40123"))


def test_a_deadline_is_a_deadline() -> None:
    stop = downstream_stop("router", grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
    assert (stop.code, stop.details) == (grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded while waiting for router")
