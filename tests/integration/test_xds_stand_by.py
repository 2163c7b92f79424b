"""A controller replica that does not lead serves no ADS: its open streams end and new ones are
refused (UNAVAILABLE, saying why), so data planes and followers reconnect to the leader instead
of keeping what it sent them last."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import grpc
import pytest
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2

from migration.xds import Endpoint, XdsControlPlane
from migration.xds.snapshot import LISTENER

ENDPOINTS = {"layered": [Endpoint("127.0.0.1", 7001)], "spine": [Endpoint("127.0.0.1", 7002)]}
REASON = "this migration controller replica does not lead; reconnect to reach the leader"


@pytest.fixture
def plane() -> Iterator[XdsControlPlane]:
    cp = XdsControlPlane(endpoints=ENDPOINTS, max_streams=8)
    cp.start()
    cp.set_weights(100, 0, "v1")
    yield cp
    cp.stop(grace=0)


def stream(plane: XdsControlPlane) -> tuple[grpc.Channel, Iterator[discovery_pb2.DiscoveryResponse]]:
    """A data plane's stream: one LDS request, then it stays open (as Envoy's does)."""
    assert plane.address is not None
    channel = grpc.insecure_channel(plane.address)
    request = discovery_pb2.DiscoveryRequest(type_url=LISTENER, resource_names=["spine-gateway"])
    request.node.id = "envoy-1"
    hang_up = threading.Event()

    def requests() -> Iterator[discovery_pb2.DiscoveryRequest]:
        yield request
        hang_up.wait(10)

    responses = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel).StreamAggregatedResources(
        requests(), timeout=10)
    return channel, responses


def test_standing_by_ends_the_open_stream_with_the_reason(plane):
    channel, responses = stream(plane)
    assert next(responses).version_info == "v1"
    plane.stand_by(REASON)
    with pytest.raises(grpc.RpcError) as ended:
        next(responses)
    assert ended.value.code() is grpc.StatusCode.UNAVAILABLE and ended.value.details() == REASON
    channel.close()


def test_a_replica_standing_by_refuses_new_streams_until_it_serves_again(plane):
    plane.stand_by(REASON)
    channel, responses = stream(plane)
    with pytest.raises(grpc.RpcError) as refused:
        next(responses)
    assert refused.value.code() is grpc.StatusCode.UNAVAILABLE and "does not lead" in refused.value.details()
    channel.close()

    plane.serve()
    channel, responses = stream(plane)
    assert next(responses).version_info == "v1"
    channel.close()
