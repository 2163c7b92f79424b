"""The pipeline: runs the steps over a batch of requests, the same way in every layout.

What a step does not decide, the runner does once for all of them:
- which requests a step sees (still open, not past their deadline);
- the hooks around each request's part (a span per request, an injected fault), with the
  request's own trace context, whichever thread decides the batch;
- the call: the component's operation through its interface, as placed now (a direct call
  in the spine, a gRPC call in the layered stack), with the step's budget as its timeout;
- a failed call: fail-closed steps stop each request of the batch (`downstream_stop`:
  UNAVAILABLE, or the component's own code where it reaches the client as is), fail-open
  steps let each one go on and count the failure;
- the time each request spent in each component (`middleware_s`).

The per-request path is `admit([state])`; the spine's micro-batcher calls `admit(batch)`.
The hooks run here and nowhere else, whatever the component's placement: a call the
gateway makes outside a step's batch (the model's) runs them through `begin_call`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Generic, TypeVar

import grpc

from services.common.log_limit import RateLimitedLog
from services.pipeline.calls import Hook
from services.pipeline.interface import CallOptions, Interface, Placed
from services.pipeline.state import Metadata, RequestState
from services.pipeline.step import Phase, Step
from services.pipeline.verdicts import Stop, downstream_stop

log = logging.getLogger("spine.pipeline")
# A middleware down fails every request that passes it: each failure at DEBUG, at most one
# line a second per component (or step) at WARNING.
_fail_open = RateLimitedLog(log, "fail-open failures")
_step_failures = RateLimitedLog(log, "failed step calls")

FailOpen = Callable[[str, str, str], None]  # (component, reason, request id)
Barrier = Callable[[list[RequestState]], None]


def _ignore(component: str, reason: str, request_id: str) -> None:
    """A fail-open failure nobody asked to count."""


class FailOpenCount:
    """A `FailOpen` that counts fail-open failures by component and logs them (rate limited);
    the request goes on.

    The runtime hands the same one to the pipeline (which calls it) and to the gateway
    (which shows the counts)."""

    def __init__(self) -> None:
        self.by_component: Counter[str] = Counter()
        self._lock = threading.Lock()

    def __call__(self, component: str, reason: str, request_id: str) -> None:
        with self._lock:
            self.by_component[component] += 1
        _fail_open(component, "fail-open middleware %s failed (%s); request %s goes on", component, reason,
                   request_id)


def code_details(error: BaseException) -> tuple[grpc.StatusCode, str, tuple[tuple[str, str], ...]]:
    """Code, details and trailers of an RpcError (a real call's, or the in-process twin)."""
    call: Any = error
    code = call.code() if callable(getattr(call, "code", None)) else grpc.StatusCode.UNKNOWN
    if not isinstance(code, grpc.StatusCode):
        code = grpc.StatusCode.UNKNOWN
    details = str(call.details() if callable(getattr(call, "details", None)) else error)
    trailing = call.trailing_metadata() if callable(getattr(call, "trailing_metadata", None)) else ()
    return code, details, tuple(trailing or ())


class Pipeline:
    """The ordered steps and the components they call, each as placed now (`Placed`)."""

    def __init__(self, steps: Iterable[Step[Any]], components: Placed, *,
                 hooks: Sequence[Hook] = (), on_fail_open: FailOpen | None = None) -> None:
        ordered = list(steps)  # in the registry's path order
        self.admission = [step for step in ordered if step.phase == Phase.ADMIT]
        self.completion = [step for step in ordered if step.phase == Phase.COMPLETE]
        self.model = next(step for step in ordered if step.phase == Phase.MODEL)
        self.components = components  # one swap per move, by the runtime
        self.hooks = list(hooks)
        self.on_fail_open = on_fail_open or _ignore
        # Run before a step decides a batch: e.g. answers handed over for the cache and not
        # yet stored go in before a lookup of the same request (see monolith.batched_pipeline).
        self.barriers: dict[str, Barrier] = {}

    def add_barrier(self, step: str, barrier: Barrier) -> None:
        """Run `barrier` before `step` decides each batch, from now on."""
        self.barriers[step] = barrier

    def remove_barrier(self, step: str, barrier: Barrier) -> None:
        """Stop running `barrier` before `step` (nothing when another one is there now)."""
        if self.barriers.get(step) == barrier:
            del self.barriers[step]

    @property
    def steps(self) -> list[Step[Any]]:
        return [*self.admission, self.model, *self.completion]

    def capture(self) -> Metadata:
        """The calling thread's context that the hooks carry (trace), for work done elsewhere."""
        captured: list[tuple[str, str]] = []
        for hook in self.hooks:
            capture = getattr(hook, "capture", None)
            if capture is not None:
                captured.extend(capture())
        return tuple(captured)

    # -- running steps --------------------------------------------------------------------
    def admit(self, batch: list[RequestState]) -> None:
        """Every admission step in order; a request a step stops has its `outcome` set."""
        for step in self.admission:
            self.run(step, batch)

    def complete(self, batch: list[RequestState], steps: Sequence[Step[Any]] | None = None, *,
                 hooks: bool = True, timed: bool = True) -> None:
        """The completion steps (or some of them) for finished requests; they fail open."""
        for step in self.completion if steps is None else steps:
            self.run(step, batch, hooks=hooks, timed=timed)

    def run(self, step: Step[Any], batch: list[RequestState], *, hooks: bool = True, timed: bool = True) -> None:
        final = step.phase == Phase.COMPLETE  # after the answer: the budget alone bounds it
        states = self._entering(step, batch, final)
        if not states or not step.decides:  # a screen-only step has decided in `_entering`
            return
        begun = self._begin(step, states) if hooks and self.hooks and step.component else None
        if begun is not None:
            states = [state for state in states if state in begun]
        call = _Call(self, step, states, begun, final)
        started = time.perf_counter()
        try:
            if states:
                barrier = self.barriers.get(step.name)
                if barrier is not None:
                    barrier(states)
                step.decide(states, call)
        except grpc.RpcError as error:  # the whole call failed: every request of the batch
            code, details, trailing = code_details(error)
            if getattr(error, "ejected", False):  # the component was failing fast: no call was made
                for state in states:
                    state.ejected.append(step.component)
            if code == grpc.StatusCode.DEADLINE_EXCEEDED and call.bounded_by_budget:
                code = grpc.StatusCode.UNAVAILABLE  # the component is slow, not the client impatient
                details = f"no answer within its {step.budget_s * 1000:g} ms budget"
                trailing = ()
            for state in states:
                call.fail(state, code, details, trailing)
        except Exception as error:  # a broken step or peer: what gRPC makes of a handler's bug
            _step_failures(step.name, "step %s failed for %d request(s): %r", step.name, len(states), error)
            for state in states:
                call.fail(state, grpc.StatusCode.UNKNOWN, f"Exception calling application: {error}")
        finally:
            spent = time.perf_counter() - started
            if timed and step.component:
                for state in states:
                    state.add_time(step.component, spent)
            if begun:
                for state in states:
                    self._end(begun[state], call.code_for(state))

    def begin_call(self, step: Step[Any], state: RequestState) -> CallHooks:
        """The hooks of one call made outside a step's batch (the gateway's to the model), begun:
        `CallHooks.metadata` goes with the call, `end` reports how it ended. A hook that fails
        the call (an injected fault) raises its `grpc.RpcError` here, before the call is made.
        Made on the request's own thread: a span's parent is the current one (the model call's
        GenAI span while tracing records it), not the trace context a batch step carries."""
        metadata: list[tuple[str, str]] = [("x-request-id", state.request_id)]
        tokens: list[Any] = []
        try:
            for hook in self.hooks:
                tokens.append(hook.begin(step.component, step.method, metadata))
        except grpc.RpcError as error:
            self._end((tokens, metadata), code_details(error)[0])
            raise
        return CallHooks(self, tokens, tuple(metadata))

    def mark(self, step: Step[Any], state: RequestState) -> None:
        """Run the hooks of a step whose write happens later, off the request path, in the
        request's own thread: its span sits under the request, and an injected fault skips
        the write (counted) just as it would fail the call itself."""
        if not self.hooks or not step.component:
            return
        begun = self._begin(step, [state])
        if state in begun:
            self._end(begun[state], grpc.StatusCode.OK)
        else:
            state.skip = state.skip | {step.name}

    def _entering(self, step: Step[Any], batch: list[RequestState], final: bool) -> list[RequestState]:
        now = time.monotonic()
        states: list[RequestState] = []
        screens = step.screens
        for state in batch:
            if not step.wants(state) or step.name in state.skip:
                continue
            stop = step.screen(state) if screens else None
            if stop is not None:
                state.outcome = stop
                continue
            if not final and now >= state.deadline and not step.fail_open:
                state.outcome = Stop(grpc.StatusCode.DEADLINE_EXCEEDED,
                                     f"deadline exceeded while waiting for {step.component or step.name}")
                continue
            states.append(state)
        return states

    def _begin(self, step: Step[Any], states: list[RequestState]) -> dict[RequestState, tuple[list[Any], list[Any]]]:
        """Each request's hook tokens and call metadata; one a hook failed is decided here."""
        begun: dict[RequestState, tuple[list[Any], list[Any]]] = {}
        for state in states:
            metadata: list[tuple[str, str]] = [("x-request-id", state.request_id), *state.trace]
            tokens: list[Any] = []
            try:
                for hook in self.hooks:
                    tokens.append(hook.begin(step.component, step.method, metadata))
            except grpc.RpcError as error:
                code, details, _ = code_details(error)
                self._end((tokens, metadata), code)
                _fail(self, step, state, code, details, ())
                continue
            begun[state] = (tokens, metadata)
        return begun

    def _end(self, begun: tuple[list[Any], list[Any]], code: grpc.StatusCode) -> None:
        tokens, _ = begun
        for hook, token in zip(reversed(self.hooks[:len(tokens)]), reversed(tokens), strict=True):
            hook.end(token, code)


class CallHooks:
    """The hooks of one call, begun (`Pipeline.begin_call`); `end` once, with its code."""

    __slots__ = ("_pipeline", "_tokens", "metadata", "_ended")

    def __init__(self, pipeline: Pipeline, tokens: list[Any], metadata: tuple[tuple[str, str], ...]) -> None:
        self._pipeline = pipeline
        self._tokens = tokens
        self.metadata = metadata
        self._ended = False

    def end(self, code: grpc.StatusCode) -> None:
        if not self._ended:
            self._ended = True
            self._pipeline._end((self._tokens, list(self.metadata)), code)


def _fail(pipeline: Pipeline, step: Step[Any], state: RequestState, code: grpc.StatusCode, details: str,
          trailing: Sequence[tuple[str, str]]) -> None:
    """One request's verdict when its part of a step failed, by the step's fail mode."""
    if step.fail_open:
        state.failures.append(step.component)
        pipeline.on_fail_open(step.component, code.name, state.request_id)
    elif state.outcome is None:
        state.outcome = downstream_stop(step.component, code, details, trailing, step.policy.passes)


C = TypeVar("C")  # the step's component interface


class _Call(Generic[C]):
    """A step's view of its component for one batch (the `StepCall` protocol)."""

    __slots__ = ("_pipeline", "_step", "_states", "_begun", "_final", "_codes", "_options", "bounded_by_budget")

    def __init__(self, pipeline: Pipeline, step: Step[C], states: list[RequestState],
                 begun: dict[RequestState, tuple[list[Any], list[Any]]] | None, final: bool) -> None:
        self._pipeline = pipeline
        self._step = step
        self._states = states
        self._begun = begun
        self._final = final
        self._codes: dict[RequestState, grpc.StatusCode] = {}
        self._options: CallOptions | None = None
        self.bounded_by_budget = False  # the call's timeout was the step's budget, not a deadline

    @property
    def component(self) -> C:
        interface: Interface[C] | None = self._step.interface
        assert interface is not None, f"{self._step.name} calls no component"
        return self._pipeline.components.get(interface)

    @property
    def options(self) -> CallOptions:
        """The call's timeout (the step's budget, or less when every request's deadline is
        nearer) and its metadata (one request's own id and trace context travel with it)."""
        if self._options is None:
            budget = self._step.budget_s
            states = self._states
            timeout = budget
            if not self._final:
                latest = states[0].deadline if len(states) == 1 else max(state.deadline for state in states)
                timeout = min(budget, max(0.001, latest - time.monotonic()))  # as `RequestState.remaining`
            self.bounded_by_budget = timeout == budget
            metadata: Sequence[tuple[str, str]] = ()
            if len(states) == 1:
                state = states[0]
                metadata = self._begun[state][1] if self._begun else (("x-request-id", state.request_id),)
            self._options = CallOptions(timeout, tuple(metadata))
        return self._options

    def fail(self, state: RequestState, code: grpc.StatusCode, message: str,
             trailing: Sequence[tuple[str, str]] = ()) -> None:
        self._codes[state] = code
        _fail(self._pipeline, self._step, state, code, message, trailing)

    def code_for(self, state: RequestState) -> grpc.StatusCode:
        if state in self._codes:
            return self._codes[state]
        outcome = state.outcome
        return outcome.code if outcome is not None else grpc.StatusCode.OK
