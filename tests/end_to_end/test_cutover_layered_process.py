"""`make run`'s arrangement: the layered stack as its own process tree under the cutover.

The spine still shares the layered middleware processes for what it has not collapsed, and
the rate limiter's share is set through a stub on the layered one; stopping the cutover
stops the tree (by PID), and so does a cutover that fails to start after the tree started."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from migration.traffic.cutover import Cutover, RunningCutover
from services.common import ConfigError
from spine.client.gateway_client import GatewayClient
from tests.conftest import DEV_KEY, SPLIT_KEYS, config_for_tests, pid_alive, split_tenant_through
from wire.v1 import generation_pb2


@pytest.fixture(scope="module")
def cutover(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningCutover]:
    rig = Cutover(config_for_tests(), Path(tmp_path_factory.mktemp("cutover-tree")), layered_process=True).start()
    try:
        yield rig
    finally:
        rig.stop()


def test_both_sides_answer_through_the_front_and_the_layered_side_is_its_own_process(cutover: RunningCutover) -> None:
    assert cutover.layered is None and cutover.layered_tree is not None
    assert cutover.layered_tree.process is not None and cutover.layered_tree.process.pid != os.getpid()
    request = generation_pb2.GenerateRequest(model="tiny-lm", prompt="which process", max_tokens=2)
    with GatewayClient(cutover.address, DEV_KEY) as client:
        for side, layouts in (("layered", {"layered"}), ("spine", {"mixed", "collapsed"})):
            result = client.generate(request, headers={"x-spine-route": side})
            assert result.ok, result.details
            # the spine shares the layered processes for all it has not collapsed: "mixed"
            assert result.trailing["x-spine-side"] == side and result.layout in layouts


@pytest.mark.parametrize("spine_ratelimit", ["remote", "local"])
def test_a_split_tenant_never_exceeds_its_limit_in_total(cutover: RunningCutover, spine_ratelimit: str) -> None:
    """Remote: the spine asks the layered tree's own rate limiter; local: each side holds its
    share, the layered one set through the stub. Either way at most the burst of 20."""
    assert cutover.target is not None
    placements = {name: "local" for name in ("logs", "metrics", "cache", "router", "auth")}
    placements["ratelimit"] = spine_ratelimit
    cutover.target.apply(50, placements, f"tree-split-{spine_ratelimit}", route_header=True)
    try:
        admitted, sides = split_tenant_through(cutover.address, SPLIT_KEYS[spine_ratelimit], f"tree {spine_ratelimit}")
        assert sides["layered"] > 10 and sides["spine"] > 10, sides
        assert 0 < admitted <= 20, f"{admitted} admitted across both layouts; the limit is 20"
    finally:
        cutover.target.apply(0, {name: "remote" for name in placements}, f"tree-split-{spine_ratelimit}-back",
                             route_header=True)


def test_stopping_the_cutover_stops_the_layered_tree(tmp_path: Path) -> None:
    rig = Cutover(config_for_tests(), tmp_path, layered_process=True).start()
    assert rig.layered_tree is not None and rig.layered_tree.process is not None
    pid = rig.layered_tree.process.pid
    children = [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    assert len(children) >= 6  # the layered components, each its own process
    rig.stop()
    assert not pid_alive(pid) and not any(pid_alive(child) for child in children)


def test_a_cutover_whose_controller_cannot_start_stops_both_sides_and_the_front(tmp_path: Path) -> None:
    """The controller starts last; refused its dashboard on every interface, it leaves nothing
    running: the layered tree, the spine and the front started before it are stopped."""
    me = psutil.Process()
    children = {child.pid for child in me.children(recursive=True)}
    listening = {c.laddr.port for c in me.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN}
    with pytest.raises(ConfigError, match="dashboard-listen"):
        Cutover(config_for_tests(), tmp_path, layered_process=True, dashboard_listen="0.0.0.0:0").start()
    log = (tmp_path / "layered.log").read_text()
    assert "serving the Gateway API" in log and "stopping" in log  # it had started, and was stopped
    left = [child for child in me.children(recursive=True) if child.pid not in children]
    assert not [child for child in left if child.is_running() and child.status() != psutil.STATUS_ZOMBIE], left
    assert {c.laddr.port for c in me.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN} <= listening
