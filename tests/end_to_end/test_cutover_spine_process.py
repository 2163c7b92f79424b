"""`make run`'s arrangement: the spine as a process of its own, following the stages over ADS.

The demo's spine used to run inside the demo's process, sharing one interpreter with the
front and the controller, so its tables compared a slowed spine with a layered stack that
had processes of its own. Here the spine is `spine up` in its own process: each stage's
placements and rate-limit share reach it over ADS (a stage counts as applied once it has
ACKed them), and its faults are switched through a pipe only the cutover holds."""

from __future__ import annotations

import argparse
import io
import json
import os
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from unittest.mock import ANY

import pytest

from migration.traffic.cutover import Cutover, RunningCutover
from migration.traffic.spine_process import FaultNotSwitched
from runtime.faults import FaultHook, FaultSwitch
from services.common import ConfigError
from services.registry import MIDDLEWARES
from spine.cli.up import _injected_fault
from spine.client.gateway_client import GatewayClient
from tests.conftest import (
    DEV_KEY,
    SPLIT_KEYS,
    config_for_tests,
    pid_alive,
    split_tenant_through,
    stop_process,
)
from tests.waiting import eventually, holds_within
from wire.v1 import generation_pb2


@pytest.fixture(scope="module")
def cutover(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningCutover]:
    rig = Cutover(config_for_tests(), Path(tmp_path_factory.mktemp("cutover-spine")), layered_process=True,
                  spine_process=True).start()
    try:
        yield rig
    finally:
        rig.stop()


def _greedy(prompt: str) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(model="tiny-lm", prompt=prompt, max_tokens=6)


def _apply(cutover: RunningCutover, weight: float, placements: dict[str, str], version: str) -> None:
    """Apply a stage as the controller does and wait until the target says it is in force."""
    assert cutover.target is not None
    cutover.target.apply(weight, placements, version, route_header=True)
    target = cutover.target
    eventually(lambda: target.applied(version), 10, f"{version} ACKed by the spine process", interval=0.05)


def test_the_spine_is_its_own_process_and_starts_on_the_layered_middlewares(cutover: RunningCutover) -> None:
    assert cutover.spine is None and cutover.spine_tree is not None and cutover.spine_tree.process is not None
    assert cutover.spine_tree.process.pid != os.getpid()
    with GatewayClient(cutover.address, DEV_KEY) as client:
        result = client.generate(_greedy("whose process"), headers={"x-spine-route": "spine"})
    assert result.ok, result.details
    assert result.trailing["x-spine-side"] == "spine" and result.layout == "mixed"


def test_a_stage_reaches_the_spine_process_over_ads_before_it_counts_as_applied(cutover: RunningCutover) -> None:
    assert cutover.target is not None and cutover.xds is not None
    everything_local = dict.fromkeys(MIDDLEWARES, "local")
    _apply(cutover, 100, everything_local, "all-local")
    assert not cutover.target.applied("a-version-never-published")
    try:
        followers = cutover.xds.followers_status()
        assert [row["role"] for row in followers] == ["spine"], followers
        with GatewayClient(cutover.address, DEV_KEY) as client:
            result = client.generate(_greedy("all of it here"))
        assert result.ok and result.layout == "collapsed", (result.details, result.layout)
    finally:
        _apply(cutover, 0, dict.fromkeys(MIDDLEWARES, "remote"), "all-remote")
    with GatewayClient(cutover.address, DEV_KEY) as client:
        result = client.generate(_greedy("back on the layered middlewares"), headers={"x-spine-route": "spine"})
    assert result.ok and result.layout == "mixed"


def test_a_split_tenant_never_exceeds_its_limit_in_total_with_the_spine_s_share_over_ads(cutover: RunningCutover) -> None:
    placements = dict.fromkeys(MIDDLEWARES, "local")
    _apply(cutover, 50, placements, "spine-split")
    try:
        admitted, sides = split_tenant_through(cutover.address, SPLIT_KEYS["local"], "split over ads")
        assert sides["layered"] > 10 and sides["spine"] > 10, sides
        assert 0 < admitted <= 20, f"{admitted} admitted across both layouts; the limit is 20"
    finally:
        _apply(cutover, 0, dict.fromkeys(MIDDLEWARES, "remote"), "spine-split-back")


def test_faults_are_switched_in_the_spine_process_and_answered(cutover: RunningCutover) -> None:
    spine = {"x-spine-route": "spine"}
    with GatewayClient(cutover.address, DEV_KEY) as client:
        layered = client.generate(_greedy("a fault to compare"), headers={"x-spine-route": "layered"})
        assert cutover.switch_fault("error-rate 1") == {"event": "fault", "command": "error-rate 1",
                                                        "error_rate": 1.0, "wrong_answers": False}
        try:
            failed = client.generate(_greedy("fails in the spine"), headers=spine)
            assert failed.code.name == "UNAVAILABLE" and "injected fault" in failed.details
            assert cutover.switch_fault("error-rate 0")["error_rate"] == 0.0
            assert cutover.switch_fault("wrong-answers on")["wrong_answers"] is True
            # One token fewer: another cache entry (the spine shares the layered cache), and
            # greedy decoding makes the right answer the layered one's first five tokens.
            shorter = _greedy("a fault to compare")
            shorter.max_tokens = 5
            wrong = client.generate(shorter, headers=spine)
        finally:
            cutover.switch_fault("clear")
        assert layered.ok and wrong.ok and not wrong.response.cached
        assert list(wrong.response.token_ids) != list(layered.response.token_ids)[:5]
        with pytest.raises(FaultNotSwitched, match="refused by the spine process"):
            cutover.switch_fault("error-rate 2")
        assert client.generate(_greedy("healthy again"), headers=spine).ok


def test_fault_commands_are_parsed_strictly() -> None:
    answers: list[str] = []
    switch = FaultSwitch(FaultHook(), answers.append)
    assert switch.apply("error-rate 0.25")["error_rate"] == 0.25
    assert switch.apply("wrong-answers on")["wrong_answers"] is True
    for bad in ("error-rate x", "error-rate -0.1", "wrong-answers maybe", "reboot", "clear now"):
        assert switch.apply(bad) == {"event": "fault-refused", "command": bad, "why": ANY}, bad
    assert switch.hook.error_rate == 0.25 and switch.hook.wrong_answers  # refusals changed nothing
    assert switch.apply("clear") == {"event": "fault", "command": "clear", "error_rate": 0.0, "wrong_answers": False}
    assert len(answers) == 8 and all(line.startswith('{"event": "fault') for line in answers)
    ended = threading.Event()
    switch.follow([b"error-rate 0.5\n", b"\xff\xfe\n", b"\n", b"wrong-answers on\n"], ended.set).join(5)
    assert ended.is_set() and switch.hook.error_rate == 0.5 and switch.hook.wrong_answers
    assert json.loads(answers[9])["event"] == "fault-refused"  # the line that is not UTF-8, refused alone


def test_the_switchable_fault_is_refused_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(sys, "stdin", Terminal())
    args = argparse.Namespace(inject_fault="switchable", allow_external=False)
    with pytest.raises(ConfigError, match="a terminal here"):
        _injected_fault(args, config_for_tests(), None)


def test_a_stage_waits_for_the_spine_before_it_sends_it_more_and_a_rollback_does_not(cutover: RunningCutover) -> None:
    """Raising the spine's weight waits for its ACK (the front stays where it was); a
    rollback to weight 0 is in force at once, even while the spine process cannot answer."""
    assert cutover.target is not None and cutover.front is not None and cutover.spine_tree is not None
    process = cutover.spine_tree.process
    assert process is not None
    stop_process(process.pid)
    try:
        cutover.target.apply(50, dict.fromkeys(MIDDLEWARES, "remote"), "while-stopped", route_header=True)
        assert not holds_within(lambda: cutover.target.applied("while-stopped"), 0.5)  # type: ignore[union-attr]
        assert cutover.front.spine_weight == 0
        cutover.target.apply(0, dict.fromkeys(MIDDLEWARES, "remote"), "rolled-back", route_header=True)
        assert cutover.target.applied("rolled-back") and cutover.front.spine_weight == 0
    finally:
        os.kill(process.pid, signal.SIGCONT)
    _apply(cutover, 30, dict.fromkeys(MIDDLEWARES, "remote"), "after-continue")
    assert cutover.front.spine_weight == 30
    _apply(cutover, 0, dict.fromkeys(MIDDLEWARES, "remote"), "after-continue-back")


def test_stopping_the_cutover_stops_the_spine_process(tmp_path: Path) -> None:
    rig = Cutover(config_for_tests(), tmp_path, layered_process=True, spine_process=True).start()
    assert rig.spine_tree is not None and rig.spine_tree.process is not None
    pid = rig.spine_tree.process.pid
    rig.stop()
    assert not pid_alive(pid)


def test_a_killed_spine_process_refuses_fault_switches_and_the_cutover_still_stops(tmp_path: Path) -> None:
    rig = Cutover(config_for_tests(), tmp_path, layered_process=True, spine_process=True).start()
    assert rig.layered_tree is not None and rig.layered_tree.process is not None
    layered_pid = rig.layered_tree.process.pid
    try:
        assert rig.spine_tree is not None and rig.spine_tree.process is not None
        process = rig.spine_tree.process
        os.kill(process.pid, signal.SIGKILL)
        process.wait(10)
        with pytest.raises(FaultNotSwitched, match="not running"):
            rig.switch_fault("error-rate 0.5")
        with GatewayClient(rig.address, DEV_KEY) as client:  # weight 0: the layered side answers
            assert client.generate(_greedy("the spine is gone")).ok
    finally:
        rig.stop()
    assert not pid_alive(layered_pid)  # the spine's death stopped nothing else from stopping


def test_moving_traffic_back_to_the_layered_side_gives_its_limiter_the_share_at_once(cutover: RunningCutover) -> None:
    """After a stage with the rate limiter in the spine (layered share near 0), a stage that
    sends the spine less traffic goes in at once, the layered limiter's share with it: the
    layered side must not refuse its new traffic while the spine is still applying the stage
    (it did, and `make run`'s failing-spine run was rolled back by the parity gate too)."""
    assert cutover.target is not None and cutover.front is not None
    _apply(cutover, 100, dict.fromkeys(MIDDLEWARES, "local"), "all-in-spine")
    try:
        cutover.target.apply(10, dict.fromkeys(MIDDLEWARES, "remote"), "back-to-layered", route_header=True)
        assert cutover.front.spine_weight == 10  # at once, before the spine's ACK
        with GatewayClient(cutover.address, DEV_KEY) as client:
            answers = [client.generate(_greedy(f"layered again {i}"), headers={"x-spine-route": "layered"})
                       for i in range(5)]
        assert [a.code.name for a in answers] == ["OK"] * 5, [a.details for a in answers]
    finally:
        _apply(cutover, 0, dict.fromkeys(MIDDLEWARES, "remote"), "back-to-layered-done")
