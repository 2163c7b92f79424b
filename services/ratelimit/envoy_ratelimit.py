"""Envoy's rate limit service API (`envoy.service.ratelimit.v3.RateLimitService`), both ways.

Serving it (`EnvoyRateLimit`): Envoy's `ratelimit` filter asks `ShouldRateLimit` and gets the
RateLimit component's decision on the very buckets Gateway traffic is charged to (through
its `ShouldRateLimit`, the descriptor form of the same decision). A descriptor is the shape
Envoy's filter sends:

    domain: <ratelimit.domain>      entries: tenant=T [, model=M] [, resource=requests|tokens]

`model` is an id or alias the router knows (absent: the router's first model); `resource`
defaults to `requests`, so `tenant=dev` is the bucket `tenant=dev,model=tiny-lm,resource=requests`
that every Gateway request of `dev` is charged one to. Its cost is the descriptor's
`hits_addend`, else the request's, where 0 means 1 (as everywhere in spine). A tenant
without its own block in `ratelimit.tenants` has the default limits, as on the Gateway path.

The answer: `OK` or `OVER_LIMIT` (all descriptors fit and are charged, or none is), and per
descriptor its bucket (`current_limit`), `limit_remaining` (whole units left after this
decision) and `duration_until_reset`: when OVER_LIMIT, the time until this cost would fit;
when OK, the time until the bucket is full again. OVER_LIMIT adds `retry-after` (seconds) to
the response. Bad input never raises:

| input | answer |
|---|---|
| empty or other domain, no descriptors, a descriptor without `tenant`, an unknown entry key, model or resource, a repeated key | `UNKNOWN`, the reason in the dynamic metadata (`error`) |
| a cost larger than the bucket can ever hold (a "negative" `hits_addend` wrapped to a huge unsigned number included) | `OVER_LIMIT` without `duration_until_reset`, the reason in the dynamic metadata |
| no room for a new bucket (the device's memory budget) | `OVER_LIMIT`, reason in the dynamic metadata |
| the rate limiter unreachable | the call fails UNAVAILABLE (Envoy's `failure_mode_deny` decides) |

Envoy's filter treats `UNKNOWN` as OK: a misconfigured filter is let through and shows in
the access log (`%DYNAMIC_METADATA(envoy.filters.http.ratelimit:error)%`), not as an outage.

Speaking it (`EnvoyRlsClient`): the `RateLimit` interface (`services.ratelimit.api`) answered
by a rate limit service the team already runs (envoyproxy/ratelimit, say). Each `admit`
item becomes one `ShouldRateLimit` with the descriptor `tenant=T, model=M` (cost 1), in
list order; OVER_LIMIT is not admitted, with `duration_until_reset` as its retry-after;
OK and UNKNOWN admit (what Envoy's filter does). The legacy service never saw token counts
and is not asked about them; a shadow copy (dry run) is admitted without asking, because
the protocol cannot decide without charging; `set_share` cannot scale a foreign service's
limits and answers the fraction it enforces: 1. The protocol has no concurrency slots
(nothing to release), so `max_concurrent_requests` is not enforced by a foreign limiter:
it grants no lease, and `release` has nothing to give back.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc
from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2 as descriptor_pb2
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
from google.protobuf import duration_pb2, struct_pb2, wrappers_pb2

from services.pipeline.batch_rpc import ItemError
from services.pipeline.envoy_calls import printable, rpc_status
from services.pipeline.interface import NO_OPTIONS, CallOptions
from services.pipeline.verdicts import internal_addresses_hidden
from services.ratelimit.admission import MAX_HITS_ADDEND, RESOURCES, AdmitItem, AdmitVerdict, OverLimit
from services.ratelimit.api import RateLimit, ReleaseItem
from services.router.config import RouterConfig
from wire.v1 import ratelimit_pb2

log = logging.getLogger("spine.envoy")

ENTRY_KEYS = ("tenant", "model", "resource")
_ENVOY = rls_pb2.RateLimitResponse
_UNITS = ((_ENVOY.RateLimit.SECOND, 1.0), (_ENVOY.RateLimit.MINUTE, 60.0), (_ENVOY.RateLimit.HOUR, 3600.0),
          (_ENVOY.RateLimit.DAY, 86400.0))
_UINT32_MAX = 2**32 - 1
_SPINE = ratelimit_pb2.RateLimitResponse
_CODES = {_SPINE.OK: _ENVOY.OK, _SPINE.OVER_LIMIT: _ENVOY.OVER_LIMIT}
_FROM_ENVOY = {_ENVOY.OK: _SPINE.OK, _ENVOY.OVER_LIMIT: _SPINE.OVER_LIMIT}


class Undecidable(ValueError):
    """A request the rate limiter cannot decide; answered UNKNOWN with this reason."""


class NeverFits(ValueError):
    """A cost no bucket can ever hold; answered OVER_LIMIT with this reason."""

    def __init__(self, message: str, index: int) -> None:
        super().__init__(message)
        self.index = index


class ModelNames:
    """Model ids and aliases as the router knows them: the `model` entry of a descriptor."""

    def __init__(self, router: RouterConfig) -> None:
        self.default = router.models[0].id
        self._ids = {name: model.id for model in router.models for name in (model.id, *model.aliases)}
        self._known = ", ".join(model.id for model in router.models)

    def resolve(self, name: str | None, where: str) -> str:
        if name is None:
            return self.default
        model = self._ids.get(name)
        if model is None:
            raise Undecidable(f"{where}: unknown model {printable(name, 64)!r}; known: {self._known}")
        return model


# -- serving Envoy ---------------------------------------------------------------------------


def _reason(message: str) -> struct_pb2.Struct:
    metadata = struct_pb2.Struct()
    metadata.update({"error": message})
    return metadata


def unknown(reason: str) -> rls_pb2.RateLimitResponse:
    return rls_pb2.RateLimitResponse(overall_code=_ENVOY.UNKNOWN, dynamic_metadata=_reason(reason))


def _duration(seconds: float) -> duration_pb2.Duration:
    duration = duration_pb2.Duration()
    duration.FromNanoseconds(round(seconds * 1e9))
    return duration


def _current_limit(name: str, refill_per_s: float) -> rls_pb2.RateLimitResponse.RateLimit:
    """The bucket's rate in the smallest unit where it is at least one (Envoy counts in whole units)."""
    for unit, seconds in _UNITS:
        if refill_per_s * seconds >= 1.0 or unit == _ENVOY.RateLimit.DAY:
            return _ENVOY.RateLimit(name=name, unit=unit,
                                    requests_per_unit=min(_UINT32_MAX, max(1, round(refill_per_s * seconds))))
    raise AssertionError("unreachable")  # pragma: no cover


def envoy_answer(answer: ratelimit_pb2.RateLimitResponse) -> rls_pb2.RateLimitResponse:
    """The spine's descriptor answer in Envoy's shape."""
    response = rls_pb2.RateLimitResponse(overall_code=_CODES.get(answer.overall_code, _ENVOY.UNKNOWN))
    never = []
    for status in answer.statuses:
        out = response.statuses.add(code=_CODES.get(status.code, _ENVOY.UNKNOWN),
                                    limit_remaining=min(_UINT32_MAX, max(0, math.floor(status.limit_remaining))))
        if status.refill_per_s > 0:
            out.current_limit.CopyFrom(_current_limit(status.limit_name, status.refill_per_s))
        if status.code == _SPINE.OVER_LIMIT:
            if status.retry_after_s < 0:
                never.append(status.limit_name)
                continue
            out.duration_until_reset.CopyFrom(_duration(status.retry_after_s))
        elif status.refill_per_s > 0:
            out.duration_until_reset.CopyFrom(
                _duration(max(0.0, status.capacity - status.limit_remaining) / status.refill_per_s))
    if response.overall_code == _ENVOY.OVER_LIMIT:
        if never:
            response.dynamic_metadata.CopyFrom(_reason(f"the cost is more than {', '.join(never)} can ever hold"))
        else:
            response.response_headers_to_add.add(key="retry-after", value=f"{max(answer.retry_after_s, 0.0):.3f}")
    return response


class EnvoyRateLimit(rls_pb2_grpc.RateLimitServiceServicer):
    """`RateLimitService.ShouldRateLimit` answered by the RateLimit component's
    `should_rate_limit`: `ratelimit()` is the component as placed at the time of each call,
    asked within `budget_s`."""

    def __init__(self, ratelimit: Callable[[], RateLimit], budget_s: float, domain: str, models: ModelNames) -> None:
        self._ratelimit = ratelimit
        self._budget_s = budget_s
        self.domain = domain
        self.models = models

    def ShouldRateLimit(self, request: rls_pb2.RateLimitRequest, context: Any) -> rls_pb2.RateLimitResponse:
        try:
            ask = self.translate(request)
        except Undecidable as error:
            return unknown(str(error))
        except NeverFits as error:
            response = rls_pb2.RateLimitResponse(overall_code=_ENVOY.OVER_LIMIT, dynamic_metadata=_reason(str(error)))
            for index in range(len(request.descriptors)):
                response.statuses.add(code=_ENVOY.OVER_LIMIT if index == error.index else _ENVOY.UNKNOWN)
            return response
        try:
            return envoy_answer(self._ratelimit().should_rate_limit(ask, CallOptions(timeout=self._budget_s)))
        except grpc.RpcError as error:
            code, details = rpc_status(error)
            if code == grpc.StatusCode.INVALID_ARGUMENT:
                return unknown(details)
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                return rls_pb2.RateLimitResponse(overall_code=_ENVOY.OVER_LIMIT, dynamic_metadata=_reason(details))
            context.abort(grpc.StatusCode.UNAVAILABLE,
                          f"ratelimit unavailable ({code.name}: {internal_addresses_hidden(details)})")
            raise AssertionError("context.abort returned") from None  # pragma: no cover

    def translate(self, request: rls_pb2.RateLimitRequest) -> ratelimit_pb2.RateLimitRequest:
        """Envoy's request as the spine's descriptor form; Undecidable / NeverFits name the field."""
        if request.domain != self.domain:
            got = "empty" if not request.domain else repr(printable(request.domain, 64))
            raise Undecidable(f"domain: expected {self.domain!r}, got {got}")
        if not request.descriptors:
            raise Undecidable("descriptors: at least one descriptor is required")
        ask = ratelimit_pb2.RateLimitRequest(domain=self.domain)
        for index, descriptor in enumerate(request.descriptors):
            where = f"descriptors[{index}]"
            fields: dict[str, str] = {}
            for entry in descriptor.entries:
                if entry.key not in ENTRY_KEYS:
                    raise Undecidable(f"{where}: unknown entry key {printable(entry.key, 64)!r}; "
                                      f"expected {', '.join(ENTRY_KEYS)}")
                if entry.key in fields:
                    raise Undecidable(f"{where}: entry {entry.key!r} given twice")
                fields[entry.key] = entry.value
            if not fields.get("tenant"):
                raise Undecidable(f"{where}: needs a non-empty 'tenant' entry")
            resource = fields.get("resource", "requests")
            if resource not in RESOURCES:
                raise Undecidable(f"{where}.resource: expected one of {', '.join(RESOURCES)}, "
                                  f"got {printable(resource, 64)!r}")
            model = self.models.resolve(fields.get("model"), f"{where}.model")
            hits = descriptor.hits_addend.value if descriptor.HasField("hits_addend") else request.hits_addend
            if hits > MAX_HITS_ADDEND:
                raise NeverFits(f"{where}.hits_addend: {hits} is more than any bucket holds "
                                f"(at most {MAX_HITS_ADDEND}; a negative number sent unsigned reads this way)", index)
            entries = [("tenant", fields["tenant"]), ("model", model), ("resource", resource)]
            ask.descriptors.add(entries=[ratelimit_pb2.RateLimitDescriptor.Entry(key=k, value=v) for k, v in entries],
                                hits_addend=hits)
        return ask


# -- speaking Envoy ----------------------------------------------------------------------------


def _seconds(duration: duration_pb2.Duration) -> float:
    return duration.seconds + duration.nanos / 1e9


def _name(entries: Any) -> str:
    return ",".join(f"{entry.key}={entry.value}" for entry in entries)


class EnvoyRlsClient:
    """The `RateLimit` interface, answered by a rate limit service speaking Envoy's protocol."""

    def __init__(self, channel: grpc.Channel, domain: str) -> None:
        self._stub = rls_pb2_grpc.RateLimitServiceStub(channel)
        self.domain = domain
        self._share_warned = False

    def _ask(self, request: rls_pb2.RateLimitRequest, deadline: float | None,
             options: CallOptions) -> rls_pb2.RateLimitResponse:
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        answer: rls_pb2.RateLimitResponse = self._stub.ShouldRateLimit(request, timeout=timeout,
                                                                       metadata=tuple(options.metadata) or None)
        return answer

    def admit(self, items: Sequence[AdmitItem], options: CallOptions = NO_OPTIONS) -> list[AdmitVerdict | ItemError]:
        """One ShouldRateLimit per item, in list order, within the one deadline."""
        deadline = None if options.timeout is None else time.monotonic() + options.timeout
        verdicts: list[AdmitVerdict | ItemError] = []
        for item in items:
            if not item.tenant or not item.model:
                field_name = "tenant" if not item.tenant else "model"
                verdicts.append(ItemError(grpc.StatusCode.INVALID_ARGUMENT, f"{field_name}: must not be empty"))
                continue
            if item.dry_run:  # the protocol cannot decide without charging: a shadow copy is not asked
                verdicts.append(AdmitVerdict(admitted=True))
                continue
            entries = [descriptor_pb2.RateLimitDescriptor.Entry(key="tenant", value=item.tenant),
                       descriptor_pb2.RateLimitDescriptor.Entry(key="model", value=item.model)]
            envoy = self._ask(rls_pb2.RateLimitRequest(
                domain=self.domain, descriptors=[descriptor_pb2.RateLimitDescriptor(entries=entries)]),
                deadline, options)
            verdict = AdmitVerdict(admitted=envoy.overall_code != _ENVOY.OVER_LIMIT)
            if not verdict.admitted:
                verdict.over = [OverLimit(status.current_limit.name or _name(entries),
                                          _seconds(status.duration_until_reset))
                                for status in envoy.statuses if status.code == _ENVOY.OVER_LIMIT]
                if not verdict.over:
                    verdict.over = [OverLimit(_name(entries), 0.0)]
                verdict.retry_after_s = max(over.retry_after_s for over in verdict.over)
            verdicts.append(verdict)
        return verdicts

    def should_rate_limit(self, request: ratelimit_pb2.RateLimitRequest,
                          options: CallOptions = NO_OPTIONS) -> ratelimit_pb2.RateLimitResponse:
        """The descriptor form, translated both ways (in the foreign service's domain). The
        requests bucket is the foreign service's `tenant, model` descriptor, as `admit` asks
        it: `resource=requests` is left out."""
        envoy = rls_pb2.RateLimitRequest(domain=self.domain)
        for descriptor in request.descriptors:
            out = envoy.descriptors.add(entries=[descriptor_pb2.RateLimitDescriptor.Entry(key=e.key, value=e.value)
                                                 for e in descriptor.entries
                                                 if (e.key, e.value) != ("resource", "requests")])
            if descriptor.hits_addend:
                out.hits_addend.CopyFrom(wrappers_pb2.UInt64Value(value=descriptor.hits_addend))
        deadline = None if options.timeout is None else time.monotonic() + options.timeout
        answer = self._ask(envoy, deadline, options)
        response = ratelimit_pb2.RateLimitResponse(overall_code=_FROM_ENVOY.get(answer.overall_code, _SPINE.UNKNOWN))
        for descriptor, status in zip(request.descriptors, answer.statuses, strict=False):
            over = status.code == _ENVOY.OVER_LIMIT
            response.statuses.add(code=_FROM_ENVOY.get(status.code, _SPINE.UNKNOWN),
                                  limit_name=status.current_limit.name or _name(descriptor.entries),
                                  limit_remaining=status.limit_remaining,
                                  retry_after_s=_seconds(status.duration_until_reset) if over else 0.0)
        if response.overall_code == _SPINE.OVER_LIMIT:
            response.retry_after_s = max((s.retry_after_s for s in response.statuses), default=0.0)
        return response

    def release(self, items: Sequence[ReleaseItem], options: CallOptions = NO_OPTIONS) -> list[bool | ItemError]:
        """Nothing to give back: the protocol has no concurrency slots, so no lease was granted."""
        return [False for _ in items]

    def set_share(self, fraction: float, options: CallOptions = NO_OPTIONS) -> float:
        if fraction < 1.0 and not self._share_warned:
            self._share_warned = True
            log.warning("the rate limiter is a foreign service (envoy-rls): its limits cannot be scaled to a "
                        "share of %.2f; it keeps enforcing all of them", fraction)
        return 1.0
