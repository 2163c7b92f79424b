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


def test_a_budget_refusal_says_nothing_is_left_even_when_a_fraction_of_a_cent_is() -> None:
    """The prompt alone would pass what is left: the header says 0, as docs/keys-and-budgets.md does."""
    from services.pipeline.verdicts import BUDGET_HEADER, rate_limit_stop
    from services.ratelimit.admission import AdmitVerdict

    stop = rate_limit_stop(AdmitVerdict(budget="the monthly budget of key k is $5 and $4.996 is spent",
                                        budget_remaining_usd=0.004, budget_resets_in_s=60.0), cost=10)
    assert stop is not None and dict(stop.trailing)[BUDGET_HEADER] == "0"
