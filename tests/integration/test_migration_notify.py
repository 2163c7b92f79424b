"""Webhook notifications against a real local HTTP receiver: signed, retried, never blocking."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from migration.gates import WindowStats
from migration.notify import SIGNATURE_HEADER, WebhookConfig, WebhookNotifier, verify
from migration.runner import parse_args, webhooks_of
from migration.testing import HEALTHY, make_controller, run_windows, three_stages
from services.common import ConfigError
from tests.waiting import eventually
from tests.webhook_receiver import Receiver

SECRET = "webhook-secret-0123456789abcdef"


@pytest.fixture
def receivers() -> Iterator[Callable[..., Receiver]]:
    made: list[Receiver] = []

    def make(*args: Any, **kwargs: Any) -> Receiver:
        made.append(Receiver(*args, **kwargs))
        return made[-1]

    yield make
    for receiver in made:
        receiver.stop()


def test_a_transition_reaches_the_receiver_with_a_valid_signature(tmp_path, receivers):
    receiver = receivers()
    notifier = WebhookNotifier(WebhookConfig(receiver.url, SECRET))
    controller, _, _ = make_controller(str(tmp_path / "m.db"))
    controller.on_transition(notifier)
    controller.start(three_stages(), "alice", "go")
    headers, body = receiver.wait_for(1)[0]
    event = json.loads(body)
    assert (event["plan"], event["stage"], event["from_state"], event["to_state"], event["action"],
            event["actor"], event["reason"]) == ("three", "logs", "pending", "progressing", "start", "alice", "go")
    assert verify(SECRET, body, headers[SIGNATURE_HEADER])
    assert not verify("another-secret-0123456789abcdef", body, headers[SIGNATURE_HEADER])
    assert not verify(SECRET, body.replace(b"alice", b"mallory"), headers[SIGNATURE_HEADER])
    notifier.close()


def test_an_automatic_rollback_carries_the_failing_gates_values(tmp_path, receivers):
    receiver = receivers()
    notifier = WebhookNotifier(WebhookConfig(receiver.url, SECRET))
    controller, target, clock = make_controller(str(tmp_path / "m.db"))
    controller.on_transition(notifier)
    controller.start(three_stages(), "alice")
    target.spine = WindowStats(requests=100, errors=30, p99_ms=10.0)
    run_windows(controller, clock, 1)
    assert controller.status.state == "rolled_back"
    bodies = [json.loads(body) for _, body in receiver.wait_for(3)]
    rollback = next(b for b in bodies if b["to_state"] == "rolling_back")
    assert rollback["actor"] == "controller" and "gates failed" in rollback["reason"]
    error_gate = next(g for g in rollback["gates"] if g["gate"] == "error_rate")
    assert (error_gate["verdict"], error_gate["threshold"]) == ("fail", 0.01)
    assert error_gate["value"] == pytest.approx(0.3)
    assert [b["to_state"] for b in bodies] == ["progressing", "rolling_back", "rolled_back"]
    notifier.close()


def test_a_failing_receiver_is_retried_with_backoff_until_it_answers(tmp_path, receivers):
    receiver = receivers(answers=(500, 503))
    notifier = WebhookNotifier(WebhookConfig(receiver.url, SECRET, backoff_s=0.01, attempts=5))
    controller, _, _ = make_controller(str(tmp_path / "m.db"))
    controller.on_transition(notifier)
    controller.start(three_stages(), "alice")
    deliveries = receiver.wait_for(3)
    assert len({body for _, body in deliveries}) == 1  # the same event, three times
    assert eventually(lambda: notifier.counts["delivered"] == 1)
    assert notifier.counts["retried"] == 2
    notifier.close()


def test_a_receiver_that_never_succeeds_is_given_up_logged_and_counted(tmp_path, receivers, caplog):
    receiver = receivers(answers=(500,) * 10)
    notifier = WebhookNotifier(WebhookConfig(receiver.url, SECRET, backoff_s=0.01, attempts=3))
    controller, _, _ = make_controller(str(tmp_path / "m.db"))
    controller.on_transition(notifier)
    with caplog.at_level("WARNING", logger="spine.migration.notify"):
        controller.start(three_stages(), "alice")
        assert eventually(lambda: notifier.counts["failed"] == 1)
    assert len(receiver.received) == 3
    logged = caplog.text
    assert "gave up after 3 attempt(s): answered 500" in logged
    assert SECRET not in logged and "path-secret" not in logged  # the host only, never a key
    notifier.close()


def test_a_hanging_receiver_never_blocks_the_controller(tmp_path, receivers):
    release = threading.Event()
    receiver = receivers(hold=release)
    notifier = WebhookNotifier(WebhookConfig(receiver.url, SECRET, timeout_s=0.5, attempts=2, backoff_s=0.01))
    controller, _, _ = make_controller(str(tmp_path / "m.db"))
    controller.on_transition(notifier)
    controller.start(three_stages(), "alice")
    assert receiver.holding.wait(20)
    # The receiver holds the first delivery; every command still completes and is recorded.
    controller.pause("alice")
    controller.resume("alice")
    controller.rollback("alice")
    assert not release.is_set()
    assert controller.status.state == "rolled_back"
    assert [row.action for row in controller.store.audit()] == ["start", "pause", "resume", "rollback",
                                                                 "rolled_back"]
    # The hung attempts time out and are counted; once it answers, the later events arrive.
    assert eventually(lambda: notifier.counts["failed"] >= 1)
    release.set()
    assert eventually(lambda: "rolled_back" in [json.loads(body)["to_state"] for _, body in receiver.received])
    notifier.close()


def test_a_full_queue_drops_the_event_and_counts_it(tmp_path, receivers):
    release = threading.Event()
    receiver = receivers(hold=release)
    notifier = WebhookNotifier(WebhookConfig(receiver.url, SECRET, queue_size=1, timeout_s=10, attempts=1))
    controller, _, _ = make_controller(str(tmp_path / "m.db"))
    controller.on_transition(notifier)
    controller.start(three_stages(), "alice")
    assert receiver.holding.wait(20)  # the first is in flight, not queued
    controller.pause("alice")  # queued
    controller.resume("alice")  # the queue is full: dropped
    assert notifier.counts["dropped"] == 1
    release.set()
    notifier.close()


def test_the_runner_signs_every_webhook_with_a_private_secret_file(tmp_path):
    base = ["--db", "x", "--listen", "unix:/tmp/x", "--target", "recording"]
    with pytest.raises(ConfigError, match="needs --webhook-secret-file"):
        webhooks_of(parse_args([*base, "--webhook-url", "http://127.0.0.1:9/h"]))
    secret = tmp_path / "secret"
    secret.write_text(SECRET)
    os.chmod(secret, 0o644)
    with pytest.raises(ConfigError, match="readable by other users"):
        webhooks_of(parse_args([*base, "--webhook-url", "http://127.0.0.1:9/h", "--webhook-secret-file", str(secret)]))
    os.chmod(secret, 0o600)
    with pytest.raises(ConfigError, match="expected http"):
        webhooks_of(parse_args([*base, "--webhook-url", "ftp://host/h", "--webhook-secret-file", str(secret)]))
    (config,) = webhooks_of(parse_args([*base, "--webhook-url", "https://hooks.example:8443/a?key=k",
                                        "--webhook-secret-file", str(secret)]))
    assert (config.secret, config.endpoint) == (SECRET, "https://hooks.example:8443")


def test_every_transition_reaches_a_webhook_of_a_controller_process(tmp_path, receivers):
    from migration.recording import RecordingTarget
    from migration.server import ControllerProcess
    from migration.testing import ADMIN_TOKEN

    receiver = receivers()
    process = ControllerProcess(str(tmp_path / "m.db"), "127.0.0.1:0", ADMIN_TOKEN,
                                RecordingTarget(layered=HEALTHY, spine=HEALTHY), tick_s=0.02,
                                webhooks=(WebhookConfig(receiver.url, SECRET),))
    process.start()
    try:
        process.controller.start(three_stages(), "alice")
        process.controller.abort("alice")
        assert [json.loads(body)["to_state"] for _, body in receiver.wait_for(2)][:2] == ["progressing", "aborted"]
        assert eventually(lambda: process.webhook_counts()[f"http://127.0.0.1:{receiver.server.server_address[1]}"]
                          ["delivered"] >= 2)
    finally:
        process.stop(grace=0.2)
