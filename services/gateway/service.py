"""The Gateway: the public API in front of the pipeline, the same code in every layout.

A request becomes a `RequestState`, is admitted by the admission steps (auth, validation,
router, rate limit, cache probe), answered by the model (or the cache), and handed to the
completion steps (cache store, logs, metrics) whatever its outcome. How admission and
completion are scheduled is the runtime's choice, never this module's:

- `DirectSteps` (`steps`): the pipeline with a batch of one, in the request's own thread
  (the layered gateway);
- the spine's micro-batcher and its deferred writer (`monolith.batched_pipeline`) decide many
  requests with the same steps.

Either way the verdicts come from the same steps, so codes, messages and trailers do not
depend on the layout or the batch size. A caller on an event loop (the HTTP front) may ask
for the whole answer or the stream there (`generate_on_loop`, `generate_stream_on_loop`,
while `serves_on_loop`): the same steps, batched on that loop, and the model awaited there
(an upstream engine's answer, or the built-in model's outputs handed over once per step).

Every answer carries the load hint of the model it was routed to (`x-spine-load`: the
model's own, or the latest the gateway has when the model was not called, see
`model_load`), and, where the router names one, the model's fallback (`x-spine-fallback`)
or, on a fallback's answers, the load of the models it stands in for
(`x-spine-primary-load`), which a client needs to know when to go back.

The output policy (`services.inference.output_policy`) runs here, where every answer passes in every
layout: a whole answer (the model's or the cache's) before it is returned, a stream's chunk
before it is released; a violation ends the call with `content_policy_violation`.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc

from services.gateway import model_calls
from services.gateway.answer_headers import answer_trailing
from services.gateway.model_calls import ModelCallSpans, Offload, first_chunk
from services.gateway.model_load import ModelLoads, models_load
from services.gateway.policing import AnswerPolicing
from services.gateway.request_ids import REQUEST_ID_HEADER, safe_request_id
from services.gateway.steps import AnswerTaps, DirectSteps, InFlight, Steps
from services.gateway.stream_tally import StreamTally, hit_chunk
from services.gateway.usage import forwarded, model_time, used
from services.gateway.wire import LAYOUT_HEADER
from services.inference.api import INFERENCE, AsyncChunkStream, ChunkStream, Generated
from services.inference.output_policy import OutputPolicy
from services.pipeline.internal_marks import SHADOW_HEADER, is_shadow
from services.pipeline.limits import NO_DEADLINE_S, RequestLimits
from services.pipeline.loop_bridge import run_on_loop
from services.pipeline.pipeline import FailOpenCount, Pipeline, code_details
from services.pipeline.state import ModelCall, RequestState
from services.pipeline.verdicts import Stop, downstream_stop
from wire.v1 import gateway_pb2_grpc, generation_pb2

log = logging.getLogger("spine.gateway")

Trailers = tuple[tuple[str, str], ...]


class Gateway(gateway_pb2_grpc.GatewayServicer):
    """Serves `spine.v1.Gateway` through the pipeline."""

    def __init__(self, pipeline: Pipeline, limits: RequestLimits, layout: str, *,
                 fail_opens: FailOpenCount, internal_key: bytes | None = None,
                 policy: OutputPolicy | None = None, genai: ModelCallSpans | None = None,
                 steps: Steps | None = None, in_flight: InFlight | None = None,
                 answered: AnswerTaps | None = None) -> None:
        self.pipeline = pipeline
        self.policing = AnswerPolicing(policy)  # None: no output policy (nothing is checked)
        self.limits = limits
        self.layout = layout
        # Verifies the front's shadow marks (`internal_marks`); None: no request is shadow.
        self.internal_key = internal_key
        # Fail-open failures by component: the count the pipeline was built to call.
        self.fail_open_failures: Counter[str] = fail_opens.by_component
        self.steps: Steps = steps if steps is not None else DirectSteps(pipeline)
        self._in_flight = in_flight if in_flight is not None else InFlight()
        self.answered = answered if answered is not None else AnswerTaps()
        self.model_load = ModelLoads(lambda: models_load(pipeline.components.get(INFERENCE)))
        # Spans for each call of the model, while tracing is on (`runtime.observability.genai_spans`).
        self.genai = genai

    @property
    def in_flight(self) -> int:
        """Requests begun and not finished."""
        return self._in_flight.count

    def set_layout(self, layout: str) -> None:
        """The layout's name in every answer's trailers from now on (it changes as components move)."""
        self.layout = layout

    # -- public API ---------------------------------------------------------------
    def Generate(self, request: generation_pb2.GenerateRequest, context: Any) -> generation_pb2.GenerateResponse:
        state = self._begin(request, context)
        with self._settled(state):
            try:
                self.steps.admission.admit(state)
                if state.hit is not None:
                    return self._hit(state, context)
                return self._answered(state, context, self._generate(state, context))
            except Stop as stop:
                self._abort(state, context, stop)
                raise AssertionError("unreachable") from None

    # -- on the caller's event loop ---------------------------------------------------------
    def serves_on_loop(self, request: generation_pb2.GenerateRequest) -> bool:
        """Whether `generate_on_loop` should serve `request` on an event loop now: every
        admission and completion step can run there (`Steps.on_loop`: a call into this process,
        CPU work of microseconds with completion writes handed to their writer thread, or a
        component in another process awaited on its grpc.aio stub through the loop bridge), no
        hook may block (an injected latency sleeps), and the model it names (an alias by what
        it last routed to) is one whose answer is awaited there (`OnLoop`: every model of the
        spine's own router, or the inference process's over grpc.aio). Asked per request:
        components move."""
        if not self.steps.on_loop or any(getattr(hook, "may_block", True) for hook in self.pipeline.hooks):
            return False
        on_loop = getattr(self.pipeline.components.get(INFERENCE), "on_loop", None)
        return on_loop is not None and bool(on_loop(self.model_load.routed(request.model)))

    async def generate_on_loop(self, request: generation_pb2.GenerateRequest, context: Any,
                               offload: Offload) -> tuple[generation_pb2.GenerateResponse, Trailers]:
        """`Generate` for a caller on an event loop (the HTTP API), where `serves_on_loop`:
        the answer and its headers as values. Admission is batched on this loop, a pass of
        it at a time (`Admission.admit_on_loop`, no leader thread); the model is awaited on
        this loop (`OnLoop`: an upstream's answer on its connections, the built-in model's
        handed over once per decode step); a placed model that cannot be awaited goes to
        `offload`. A verdict is raised as `grpc.RpcError` with the trailers it goes out
        with, as `Generate` does."""
        state = self._begin(request, context)
        async with self._settled_on_loop(state):
            try:
                await self.steps.admission.admit_on_loop(state)
                if state.hit is not None:
                    return self._hit(state, context), context.trailing_metadata()
                generated = await self._generate_on_loop(state, context, offload)
                return self._answered(state, context, generated), context.trailing_metadata()
            except Stop as stop:
                self._abort(state, context, stop)
                raise AssertionError("unreachable") from None

    def _hit(self, state: RequestState, context: Any) -> generation_pb2.GenerateResponse:
        """The cache's answer, policed."""
        assert state.hit is not None
        self.policing.answer(state, state.hit)
        context.set_trailing_metadata(self._answer_trailing(state))
        return state.hit

    def _answered(self, state: RequestState, context: Any, generated: Generated) -> generation_pb2.GenerateResponse:
        """The model's whole answer, counted and policed, its trailers set."""
        response, trailers = generated.response, generated.trailing
        self.model_load.note_trailers(state.model, trailers)
        model_time(state, trailers)
        used(state, response.prompt_tokens, response.completion_tokens, response.cached_prompt_tokens)
        self.policing.answer(state, response)
        state.response = response
        context.set_trailing_metadata(self._answer_trailing(state, forwarded(trailers)))
        return response

    def GenerateStream(self, request: generation_pb2.GenerateRequest,
                       context: Any) -> Iterator[generation_pb2.GenerateChunk]:
        state = self._begin(request, context)
        state.streamed = True
        with self._settled(state):
            try:
                self.steps.admission.admit(state)
                hit = self._stream_hit(state, context)
                if hit is not None:
                    yield hit
                    return
                tally = self._stream_begin(state, context)
                stream = self._generate_stream(state, context)
                ended = False
                try:
                    for chunk in stream:
                        self._stream_chunk(state, context, tally, chunk, stream)
                        yield chunk
                    ended = True
                except grpc.RpcError as error:
                    ended = True
                    raise self._model_stop(error, state) from None
                finally:
                    if not ended:  # the client went away (GeneratorExit at the yield): stop the model now
                        stream.cancel()
                    tally.settle(state, self.pipeline.model.component)
                self._stream_end(state, context, tally, stream)
            except Stop as stop:
                self._abort(state, context, stop)
            except GeneratorExit:  # the caller closed the stream: its reason, where its context says one
                state.status = getattr(context, "cancelled_as", "") or "CANCELLED"
                raise

    async def generate_stream_on_loop(self, request: generation_pb2.GenerateRequest, context: Any,
                                      offload: Offload) -> AsyncIterator[generation_pb2.GenerateChunk]:
        """`GenerateStream` for a caller on an event loop (the HTTP API), where
        `serves_on_loop`: admission batched on this loop, the model's stream read on it chunk
        by chunk (`OnLoop`); a placed model that cannot be awaited is read through `offload`,
        a chunk at a time. The same chunks, verdicts and trailers; closing the generator (the
        client left) stops the model at once."""
        state = self._begin(request, context)
        state.streamed = True
        async with self._settled_on_loop(state):
            try:
                await self.steps.admission.admit_on_loop(state)
                hit = self._stream_hit(state, context)
                if hit is not None:
                    yield hit
                    return
                tally = self._stream_begin(state, context)
                stream = self._generate_stream_on_loop(state, context, offload)
                ended = False
                try:
                    async for chunk in stream:
                        self._stream_chunk(state, context, tally, chunk, stream)
                        yield chunk
                    ended = True
                except grpc.RpcError as error:
                    ended = True
                    raise self._model_stop(error, state) from None
                finally:
                    if not ended:
                        await stream.cancel()
                    tally.settle(state, self.pipeline.model.component)
                self._stream_end(state, context, tally, stream)
            except Stop as stop:
                self._abort(state, context, stop)
            except GeneratorExit:
                state.status = getattr(context, "cancelled_as", "") or "CANCELLED"
                raise

    # -- a stream's steps, the same on a thread and on a loop ---------------------------------
    def _stream_hit(self, state: RequestState, context: Any) -> generation_pb2.GenerateChunk | None:
        """The cache's answer as the stream's one chunk, policed (None: no hit)."""
        hit = state.hit
        if hit is None:
            return None
        self.policing.answer(state, hit)
        context.set_trailing_metadata(self._answer_trailing(state))
        return hit_chunk(hit)

    def _stream_begin(self, state: RequestState, context: Any) -> StreamTally:
        assert state.resolved is not None
        # Until the stream ends: what an HTTP client's headers carry (the load hint known now).
        context.set_trailing_metadata(self._answer_trailing(state))
        return StreamTally(time.perf_counter(), self.policing.stream(state))

    def _stream_chunk(self, state: RequestState, context: Any, tally: StreamTally,
                      chunk: generation_pb2.GenerateChunk, stream: Any) -> None:
        """One chunk before it is released: policed (Stop ends the stream; the chunk is never
        released and the model stops), counted; the first one sets the answer's headers."""
        self.policing.chunk(state, tally.check, chunk)
        if tally.take(chunk):  # the first: the HTTP front's headers go out with it, what is known now
            state.model_wait_s = time.perf_counter() - tally.started
            first_chunk(state)
            initial = forwarded(stream.initial_metadata() or ())
            model_time(state, initial)
            context.set_trailing_metadata(self._answer_trailing(state, initial))

    def _stream_end(self, state: RequestState, context: Any, tally: StreamTally, stream: Any) -> None:
        """The stream's whole answer, for the completions (cache, logs), and its trailers."""
        model_trailers = forwarded(tally.end(state, stream.trailing_metadata() or ()))
        self.model_load.note_trailers(state.model, model_trailers)
        context.set_trailing_metadata(self._answer_trailing(state, model_trailers))

    # -- the request's life -----------------------------------------------------------
    def _begin(self, request: generation_pb2.GenerateRequest, context: Any) -> RequestState:
        metadata = tuple(context.invocation_metadata() or ())
        md = dict(metadata)
        remaining = context.time_remaining()
        if remaining is None or remaining > NO_DEADLINE_S:
            remaining = self.limits.default_deadline_s
        request_id = safe_request_id(md.get(REQUEST_ID_HEADER))
        started = time.perf_counter()
        state = RequestState(
            request=request,
            request_id=request_id,
            layout=self.layout,
            started=started,
            arrived=getattr(context, "arrived", None) or started,
            deadline=time.monotonic() + remaining,
            # Only a copy the front marked: a client claiming shadow would skip its rate limit.
            shadow=SHADOW_HEADER in md and is_shadow(self.internal_key, md[SHADOW_HEADER], request_id),
            metadata=metadata,
            model=request.model,
            device_busy=self.model_load.busy(),
        )
        context.set_trailing_metadata(self._trailing(state))
        self._in_flight.enter()
        return state

    def _generate(self, state: RequestState, context: Any) -> Generated:
        """The model's whole answer (`services.gateway.model_calls`); its time is the model's."""
        started = time.perf_counter()
        state.model_call = ModelCall(False, started)
        try:
            return model_calls.generate(self.pipeline, state, context, self.genai)
        except grpc.RpcError as error:
            raise self._model_failed(error, state) from None
        finally:
            elapsed = time.perf_counter() - started
            state.add_time(self.pipeline.model.component, elapsed)
            state.model_wait_s = elapsed

    async def _generate_on_loop(self, state: RequestState, context: Any, offload: Offload) -> Generated:
        """`_generate` for a caller on an event loop (`model_calls.answer_on_loop`)."""
        started = time.perf_counter()
        state.model_call = ModelCall(False, started)
        try:
            return await model_calls.answer_on_loop(self.pipeline, state, context, offload, self.genai)
        except grpc.RpcError as error:
            raise self._model_failed(error, state) from None
        finally:
            elapsed = time.perf_counter() - started
            state.add_time(self.pipeline.model.component, elapsed)
            state.model_wait_s = elapsed

    def _generate_stream(self, state: RequestState, context: Any) -> ChunkStream:
        started = time.perf_counter()
        state.model_call = ModelCall(True, started)
        try:
            return model_calls.generate_stream(self.pipeline, state, context, self.genai)
        except grpc.RpcError as error:
            state.model_wait_s = time.perf_counter() - started
            raise self._model_failed(error, state) from None

    def _generate_stream_on_loop(self, state: RequestState, context: Any, offload: Offload) -> AsyncChunkStream:
        """`_generate_stream` for a caller on an event loop (`model_calls.stream_on_loop`)."""
        started = time.perf_counter()
        state.model_call = ModelCall(True, started)
        try:
            return model_calls.stream_on_loop(self.pipeline, state, context, offload, self.genai)
        except grpc.RpcError as error:
            state.model_wait_s = time.perf_counter() - started
            raise self._model_failed(error, state) from None

    def _model_failed(self, error: grpc.RpcError, state: RequestState) -> Stop:
        if getattr(error, "ejected", False):  # the component was failing fast: no call was made
            state.ejected.append(self.pipeline.model.component)
        return self._model_stop(error, state)

    def _model_stop(self, error: grpc.RpcError, state: RequestState) -> Stop:
        code, details, trailing = code_details(error)
        self.model_load.note_trailers(state.model, trailing)
        model_time(state, trailing)
        model = self.pipeline.model
        return downstream_stop(model.component, code, details, trailing, model.policy.passes)

    @contextlib.contextmanager
    def _settled(self, state: RequestState) -> Iterator[None]:
        """Whatever ends a call, its completions run (`_finish`); an error no verdict named
        is INTERNAL in the request's record. Both rpcs end through here."""
        try:
            yield
        except Exception:
            if state.status == "OK":
                state.status = "INTERNAL"
            raise
        finally:
            self._finish(state)

    @contextlib.asynccontextmanager
    async def _settled_on_loop(self, state: RequestState) -> AsyncIterator[None]:
        """`_settled` on an event loop: completions in another process are awaited there."""
        try:
            yield
        except Exception:
            if state.status == "OK":
                state.status = "INTERNAL"
            raise
        finally:
            if self.steps.in_process:  # every completion a call into this process: inline
                self._finish(state)
            else:
                await run_on_loop(self._finish, state)

    def _abort(self, state: RequestState, context: Any, stop: Stop) -> None:
        """End the call with the pipeline's verdict; its trailers name layout and request id."""
        state.status, state.details = stop.code.name, stop.details
        if stop.code == grpc.StatusCode.CANCELLED:  # the caller's reason, where its context says one
            state.status = getattr(context, "cancelled_as", "") or state.status
        context.set_trailing_metadata(self._answer_trailing(state, stop.trailing))
        context.abort(stop.code, stop.details)

    def _finish(self, state: RequestState) -> None:
        """The completion steps for every request, whatever its outcome (all fail open)."""
        self._in_flight.leave()
        ended = time.perf_counter()
        state.latency_s = ended - state.started
        if state.model_call is not None:  # the GenAI operation ends with the answer or the last chunk
            state.model_call.duration_s = ended - state.model_call.started
            if self.genai is not None:
                self.genai.end(state)
        if state.status != "OK":
            state.response = None  # only a good answer is worth keeping
        self.steps.completions.complete(state)
        self.answered(state)

    def _trailing(self, state: RequestState) -> tuple[tuple[str, str], ...]:
        return ((LAYOUT_HEADER, self.layout), (REQUEST_ID_HEADER, state.request_id))

    def _answer_trailing(self, state: RequestState,
                         downstream: tuple[tuple[str, str], ...] = ()) -> tuple[tuple[str, str], ...]:
        return answer_trailing(state, self._trailing(state), self.model_load, downstream)
