"""A migration from a real LiteLLM proxy to the spine, with the official openai SDK as the client.

One rig for the module (LiteLLM is slow to start; `LegacyRig.timings` says how slow): the
model server, LiteLLM in front of it (offline, on loopback), a collapsed spine serving the
same model with LiteLLM's key imported, and the HTTP front with the controller. Then the
plan (deploy/plans/legacy-litellm.yaml) is walked from LiteLLM to the spine:

- healthy: promoted, and not one client call failed on the way;
- the spine answering half its calls with 5xx: rolled back by the error-rate gate, and every
  call after the rollback goes to LiteLLM and succeeds;
- the spine answering greedy requests differently (every call succeeds): rolled back by parity;
- LiteLLM itself failing during a stage: its failures counted on its side, never the spine's,
  and the stage holds (never promoted on a broken baseline).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import anthropic
import openai
import pytest

from migration.status import State
from spine.tools.demo.legacy_rig import LegacyRig, LegacyTraffic
from tests.waiting import eventually


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LegacyRig]:
    legacy = LegacyRig(Path(tmp_path_factory.mktemp("legacy")))
    legacy.start()
    print(f"\nstarted in {legacy.timings}")
    try:
        yield legacy
    finally:
        legacy.stop()


def audit(rig: LegacyRig) -> str:
    """The controller's latest transitions, newest first, one line each, the verdicts of its
    last window's gates (why a stage that neither moved nor rolled back held), and LiteLLM's
    last words if its proxy died."""
    view = rig.cutover.controller.controller.view(audit_rows=4)  # type: ignore[union-attr]
    gates = [f"gate {gate.gate} (stage {gate.stage}): {gate.verdict}: {gate.message}" for gate in view.last_gates]
    died = [] if rig.gateway is None or rig.gateway.alive() else [
        f"LiteLLM's proxy died (its log: {rig.gateway.run_dir / 'litellm.log'}): {rig.gateway.log_tail(600)}"]
    return "\n".join([*(f"{entry.action}: {entry.reason}" for entry in view.recent_audit), *gates, *died])


def plan(rig: LegacyRig, canary_weight: int = 20) -> str:
    """The shipped plan against this rig's LiteLLM, with 2 s windows of at least 4 requests a
    side: on a loaded 2-core machine LiteLLM answers a few calls a second, and a 1 s window of
    a 20% canary would hold too few to judge. A fault run's canary takes half the traffic."""
    text = rig.plan_text().replace("window_s: 1", "window_s: 2").replace("min_window_requests: 5",
                                                                           "min_window_requests: 4")
    return text.replace("spine_weight: 20", f"spine_weight: {canary_weight}")


def reset(rig: LegacyRig) -> None:
    """Every call to LiteLLM again, no fault on the spine, and the last run's shadow copies
    compared and scraped (a late comparison would land in the next run's first window)."""
    assert rig.cutover is not None and rig.cutover.front is not None
    controller = rig.cutover.controller.controller  # type: ignore[union-attr]
    if controller.status.state is State.PROGRESSING:  # an earlier test's plan that never finished
        controller.abort(actor="test", reason="a new test begins")
    rig.switch_fault("clear")
    rig.cutover.front.set_weight(0)
    mirror = rig.cutover.front.mirror
    eventually(lambda: mirror is None or mirror.idle(), timeout=15, what="the last run's copies compared")
    time.sleep(0.3)  # the parity source scrapes every 0.25 s


def test_the_front_splits_litellms_clients_and_forwards_their_key(rig: LegacyRig) -> None:
    assert rig.cutover is not None and rig.cutover.front is not None
    front = rig.cutover.front
    sdk = openai.OpenAI(base_url=rig.cutover.base_url, api_key=rig.master_key, max_retries=0)
    ask = {"model": "default", "max_tokens": 4, "temperature": 0,
           "messages": [{"role": "user", "content": "Hello!"}]}
    sides, upstream = {}, {}
    for route in ("legacy", "spine"):
        raw = sdk.chat.completions.with_raw_response.create(**ask, extra_headers={"x-spine-route": route})
        sides[route] = (raw.headers["x-spine-side"], raw.parse().choices[0].message.content)
        upstream[route] = raw.headers.get("x-spine-upstream")
    assert upstream["spine"] and upstream["legacy"] is None  # the spine's model is the model server, as LiteLLM's is
    assert sides["legacy"][0] == "legacy" and sides["spine"][0] == "spine"
    assert sides["legacy"][1] == sides["spine"][1]  # the same model behind both: the same greedy text
    # Anthropic's API through both (LiteLLM translates it to its upstream's chat completions).
    claude = anthropic.Anthropic(base_url=f"http://{rig.cutover.address}", api_key=rig.master_key, max_retries=0)
    texts = {}
    for route in ("legacy", "spine"):
        raw = claude.messages.with_raw_response.create(model="default", max_tokens=4, extra_body={"temperature": 0},
                                                       messages=[{"role": "user", "content": "Hello!"}],
                                                       extra_headers={"x-spine-route": route})
        assert raw.headers["x-spine-side"] == route
        texts[route] = "".join(block.text for block in raw.parse().content if block.type == "text")
    assert texts["legacy"] == texts["spine"] == sides["spine"][1]
    # LiteLLM's key reached the spine unchanged (its auth accepts it); a wrong key is refused by both.
    for route in ("legacy", "spine"):
        with pytest.raises((openai.AuthenticationError, openai.BadRequestError)):
            openai.OpenAI(base_url=rig.cutover.base_url, api_key="sk-not-a-key", max_retries=0).chat.completions \
                .create(**ask, extra_headers={"x-spine-route": route})
    # Sticky: one conversation stays on one side at a split weight.
    front.set_weight(50)
    seen = {sdk.chat.completions.with_raw_response.create(**ask, extra_headers={"x-session-id": "one"})
            .headers["x-spine-side"] for _ in range(5)}
    assert len(seen) == 1
    front.set_weight(0)


def test_healthy_spine_is_promoted_without_a_failed_call(rig: LegacyRig) -> None:
    reset(rig)
    traffic = LegacyTraffic(rig.cutover.base_url, rig.master_key).start()  # type: ignore[union-attr]
    try:
        state = rig.walk(plan(rig), timeout_s=150)
        time.sleep(0.5)  # calls at 100% spine
    finally:
        calls = traffic.stop()
    failed = [call.error for call in calls if call.error]
    assert state is State.PROMOTED, audit(rig)
    assert failed == [] and len(calls) > 50
    assert {call.side for call in calls if call.side} == {"legacy", "spine"}


def test_a_spine_answering_5xx_is_rolled_back_by_the_error_rate_gate(rig: LegacyRig) -> None:
    reset(rig)
    rig.switch_fault("error-rate 0.5")
    traffic = LegacyTraffic(rig.cutover.base_url, rig.master_key).start()  # type: ignore[union-attr]
    try:
        state = rig.walk(plan(rig, canary_weight=50), timeout_s=150)
        rolled_back_at = time.time()
        time.sleep(1.0)
    finally:
        calls = traffic.stop()
        rig.switch_fault("clear")
    assert state is State.ROLLED_BACK and "error_rate" in audit(rig), audit(rig)
    assert any("InternalServerError" in call.error for call in calls)  # the spine's 503s reached clients
    after = [call for call in calls if call.started > rolled_back_at]
    assert after and all(not call.error for call in after)
    assert {call.side for call in after if call.side} == {"legacy"}  # every call back on LiteLLM


def test_a_spine_answering_differently_is_rolled_back_by_parity(rig: LegacyRig) -> None:
    reset(rig)
    rig.switch_fault("wrong-answers on")
    traffic = LegacyTraffic(rig.cutover.base_url, rig.master_key).start()  # type: ignore[union-attr]
    try:
        state = rig.walk(plan(rig, canary_weight=50), timeout_s=150)
    finally:
        calls = traffic.stop()
        rig.switch_fault("clear")
    assert state is State.ROLLED_BACK and "parity" in audit(rig), audit(rig)
    assert [call.error for call in calls if call.error] == []  # every call succeeded: only parity could tell
    mirror = rig.cutover.front.mirror  # type: ignore[union-attr]
    assert any("text" in mismatch.fields for mismatch in mirror.mismatches)


def test_litellm_failing_during_a_stage_is_its_own_error_and_never_promotes(rig: LegacyRig) -> None:
    """Last: it stops LiteLLM. Its failures are counted on the legacy side; the spine's
    window stays clean; the error-rate gate holds the stage instead of passing it."""
    reset(rig)
    assert rig.cutover is not None and rig.cutover.front is not None and rig.gateway is not None
    controller = rig.cutover.controller.controller
    held = plan(rig).replace("hold_s: 3", "hold_s: 2")  # a hold that ends while LiteLLM is down
    traffic = LegacyTraffic(rig.cutover.base_url, rig.master_key).start()
    try:
        from migration.plan import load_plan

        controller.start(load_plan(held), actor="test", reason="legacy goes down")
        eventually(lambda: controller.status.state is State.PROGRESSING, timeout=30, what="the migration under way")
        rig.gateway.stop()  # LiteLLM is gone: connections refused
        down_at = time.time()
        stage_at_down = controller.status.stage_index
        time.sleep(7.0)  # longer than the hold, three windows and more
        status = controller.status
        window = rig.cutover.front.window(down_at + 0.5)
    finally:
        calls = traffic.stop()
        controller.abort(actor="test", reason="end of the test")
    # held: neither advanced nor promoted while its baseline was down
    assert status.state is State.PROGRESSING and status.stage_index == stage_at_down, audit(rig)
    assert status.last_verdict == "inconclusive"
    assert window["layered"].errors == window["layered"].requests > 0  # every legacy call failed, counted there
    assert window["spine"].errors == 0 and window["spine"].requests > 0
    after = [call for call in calls if call.started > down_at]
    assert any("InternalServerError" in call.error and "502" in call.error for call in after)  # the front's 502
    assert all(not call.error for call in after if call.side == "spine")
    errors = [gate for gate in controller.view().last_gates if gate.gate == "error_rate"]
    assert errors and errors[0].verdict == "inconclusive" and "never a reason to pass" in errors[0].message
