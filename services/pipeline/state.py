"""What the pipeline learns about one request as it goes down the steps.

One object per request, handed from step to step whether the request is decided alone
or in a micro-batch; a step that stops the request sets `outcome`, and later steps pass
it by. The completion steps (cache store, logs, metrics) read what the others wrote.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from services.pipeline.verdicts import Stop
from wire.v1 import auth_pb2, generation_pb2

Metadata = tuple[tuple[str, str], ...]


@dataclass(eq=False, slots=True)
class ModelCall:
    """The request's call to the model as the gateway saw it: the GenAI operation that its
    span and the client metrics describe (`services.common.genai_semconv`), the same in every
    layout because the gateway makes the call in every layout."""

    stream: bool
    started: float  # time.perf_counter() when the gateway called the model
    first_chunk_s: float = 0.0  # a stream's first chunk, counted from `started` (0: none came)
    duration_s: float = 0.0  # to the answer, or to a stream's last chunk (set when the request ends)
    span: Any = None  # the GenAI span while tracing records one (runtime.observability.genai_spans)


@dataclass(eq=False, slots=True)
class RequestState:
    request: generation_pb2.GenerateRequest  # as the client sent it
    request_id: str
    layout: str
    started: float  # time.perf_counter() at arrival
    deadline: float  # time.monotonic() by which the client wants its answer
    shadow: bool
    metadata: Metadata  # the client's invocation metadata
    # The hooks' view of the request's context (trace), captured in its own thread: a batch
    # may be decided, and its completions written, on another thread.
    trace: Metadata = ()
    streamed: bool = False  # the client asked for a stream (GenerateStream)
    outcome: Stop | None = None
    # Auth's verdict for the credential, shared read-only with every request of the same API key.
    principal: auth_pb2.Principal | None = None
    tenant: str = ""
    model: str = ""
    resolved: generation_pb2.GenerateRequest | None = None  # the request naming the routed model
    cacheable: bool | None = None  # None: the cache could not say
    cache_key: bytes = b""  # the cache's key, sent back with the store
    hit: generation_pb2.GenerateResponse | None = None
    response: generation_pb2.GenerateResponse | None = None  # a fresh answer, for the cache
    status: str = "OK"
    details: str = ""  # the status's message when a step or the model stopped the request
    cached: bool = False
    pregenerated: bool = False  # the hit came from the pre-generated table
    policy_violation: bool = False  # the output policy ended the answer
    completion_tokens: int = 0
    latency_s: float = 0.0  # arrival to answer; set when the answer goes out
    middleware_s: dict[str, float] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)  # fail-open components that failed for it
    ejected: list[str] = field(default_factory=list)  # components that were failing fast when it came
    skip: frozenset[str] = frozenset()  # steps a hook already failed (written later, off the request path)
    # The device's busy fraction (0..1, 0 unknown) as the gateway last saw it in the model's
    # load hints; sent with the rate-limit ask (concurrency limits may halve while busy).
    device_busy: float = 0.0
    # The concurrency slot the rate limiter granted (0: none), and the rate limiter (as placed
    # at its admission: `services.ratelimit.api.RateLimit`) that granted it: the release goes
    # there even if the component has moved since.
    lease_id: int = 0
    lease_holder: object | None = None
    # When the request reached the process (time.perf_counter(); a front's reading of it
    # included), and the model's share of the time since (an upstream's own exchanges, else
    # the model call as the gateway saw it): their difference is x-spine-overhead-duration-ms.
    arrived: float = 0.0
    model_wait_s: float = 0.0
    # What the request used, prompt and completion (an aborted stream's up to where it
    # stopped; 0 for an answer from the cache): what the rate limiter's charge at admission is
    # settled against, and what its spend is priced on; with the prompt's share, and how much
    # of the prompt the model reused from a cache (an upstream's count).
    tokens_used: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    # The least budget left to its key, team or tenant (USD; -1: none applies).
    budget_remaining_usd: float = -1.0
    fallback: str = ""  # the router's fallback for the routed model ("" if none)
    fallback_of: tuple[str, ...] = ()  # the models the routed one is the fallback of
    model_call: ModelCall | None = None  # None: the model was not called (refused, a cache hit)

    @property
    def open(self) -> bool:
        """Still going: no step has stopped it."""
        return self.outcome is None

    def remaining(self) -> float:
        return max(0.001, self.deadline - time.monotonic())

    def add_time(self, component: str, seconds: float) -> None:
        self.middleware_s[component] = self.middleware_s.get(component, 0.0) + seconds
