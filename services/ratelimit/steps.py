"""The rate limiter's steps: admission before the model, the concurrency slot's release after.

Apart from `services.ratelimit.service` (the servicer and its token-bucket table, which keep tensors):
a gateway whose rate limiter runs in another process imports these and not torch.
"""

from __future__ import annotations

from dataclasses import replace
from typing import cast

from services.pipeline.limits import RequestLimits
from services.pipeline.state import RequestState
from services.pipeline.step import FailMode, Phase, Step, StepCall, StepPolicy
from services.pipeline.verdicts import rate_limit_cost, rate_limit_stop
from services.ratelimit.admission import AdmitItem
from services.ratelimit.api import RATELIMIT, RateLimit, ReleaseItem


class RateLimitStep(Step[RateLimit]):
    """The pipeline asks RateLimit to admit a request against its tenant's limits (fail closed).

    Shadow copies are decided without consuming budget (dry run). A request of a tenant with
    a concurrency limit comes back holding a lease, valid until its deadline; the limiter
    that granted it (the one placed at this call: a placement may change before the request
    ends) is where `ReleaseStep` gives it back."""

    interface = RATELIMIT
    method = "Admit"

    def decide(self, batch: list[RequestState], call: StepCall[RateLimit]) -> None:
        items: dict[RequestState, AdmitItem] = {}
        for state in batch:
            assert state.resolved is not None
            items[state] = _item(state)
        limiter = call.component
        verdicts = limiter.admit(list(items.values()), call.options)
        for state, verdict in self.answered(call, batch, verdicts):
            state.lease_holder = limiter  # a slot, or tokens to settle, go back there
            if verdict.lease_id:
                state.lease_id = verdict.lease_id
            state.budget_remaining_usd = verdict.budget_remaining_usd
            state.outcome = rate_limit_stop(verdict, items[state].tokens)


def _item(state: RequestState) -> AdmitItem:
    """The admission's ask: the tenant's and, for a key managed at run time, the key's own."""
    assert state.resolved is not None
    principal = state.principal
    item = AdmitItem(state.tenant, state.resolved.model, rate_limit_cost(state.resolved), state.shadow,
                     state.remaining(), state.device_busy)
    if principal is not None and principal.subject:
        item.key, item.team = principal.subject, principal.team
        item.key_requests_per_minute, item.key_tokens_per_minute = (principal.requests_per_minute,
                                                                    principal.tokens_per_minute)
        item.key_budget_usd, item.key_budget_window = principal.budget_usd, principal.budget_window
    return item


class ReleaseStep(Step[RateLimit]):
    """Gives a request's concurrency slot back at its last byte, whatever its outcome, and
    settles its tokens with what it used (`tokens_used`: the model's own count, or the tokens
    it generated, an aborted stream's up to where it stopped), so tokens per minute count what
    the request really used, streams included; the same usage is its spend.

    Not deferrable: the spine writes other completions a window later, but a slot held that
    long would refuse the tenant's next request. It fails open: a lease the call could not
    give back expires at the request's deadline."""

    interface = RATELIMIT
    method = "Release"
    phase = Phase.COMPLETE
    deferrable = False

    def __init__(self, policy: StepPolicy, limits: RequestLimits) -> None:
        super().__init__(replace(policy, fail_mode=FailMode.OPEN), limits)

    def wants(self, state: RequestState) -> bool:
        return state.lease_id != 0 or (state.tokens_used != 0 and not state.shadow and state.lease_holder is not None)

    def decide(self, batch: list[RequestState], call: StepCall[RateLimit]) -> None:
        holders: dict[int, tuple[RateLimit, list[RequestState]]] = {}
        for state in batch:
            holder = call.component if state.lease_holder is None else cast(RateLimit, state.lease_holder)
            holders.setdefault(id(holder), (holder, []))[1].append(state)
        for holder, states in holders.values():
            released = holder.release([_release(state) for state in states], call.options)
            for state, _ in self.answered(call, states, released):
                state.lease_id = 0


def _release(state: RequestState) -> ReleaseItem:
    if not state.tokens_used or state.shadow or state.resolved is None:
        return ReleaseItem(lease_id=state.lease_id)
    principal = state.principal
    key, team, key_tpm = ("", "", 0.0) if principal is None else (principal.subject, principal.team,
                                                                 principal.tokens_per_minute)
    return ReleaseItem(
        lease_id=state.lease_id, tenant=state.tenant, model=state.resolved.model,
        tokens_charged=rate_limit_cost(state.resolved), tokens_used=state.tokens_used, key=key, team=team,
        prompt_tokens=state.prompt_tokens, cached_prompt_tokens=state.cached_tokens,
        completion_tokens=max(0, state.tokens_used - state.prompt_tokens), key_tokens_per_minute=key_tpm)
