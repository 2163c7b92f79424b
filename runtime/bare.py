"""The model alone over HTTP and gRPC: `spine up --layout bare`.

What an inference engine's own server is (vLLM's `vllm serve`, llama.cpp's `llama-server`):
the inference component and nothing else — no auth, rate limit, cache, logs or metrics
middleware — behind the same OpenAI/Anthropic-compatible HTTP API as every layout
(`runtime/http/`: `/v1/chat/completions`, `/v1/completions`, `/v1/messages`, `/v1/models`,
streams) and its gRPC `Inference` service. It is the upstream a gateway (LiteLLM, the spine
with `upstream:` models) calls, and the "model alone" row of the bench.

One optional API key, as vLLM's `--api-key`: when set, every HTTP request must carry it
(`Authorization: Bearer KEY` or `x-api-key: KEY`) and every gRPC call other than health and
reflection its `authorization: Bearer KEY` metadata; otherwise 401 / UNAUTHENTICATED. The
key is compared in constant time and never logged.

Model names are the router section's ids and aliases of the models the inference
component serves (an alias is resolved here, since no router runs), so a client asks the
bare server for `default` exactly as it asks the spine.
"""

from __future__ import annotations

import hmac
import logging
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from runtime.config.model import SpineConfig
from services.router.config import RouterConfig
from wire.v1 import generation_pb2

# A server interceptor of any request and response (generic in grpc's stubs only).
if TYPE_CHECKING:
    Interceptor = grpc.ServerInterceptor[Any, Any]
else:
    Interceptor = grpc.ServerInterceptor

log = logging.getLogger("spine.bare")

BARE_LAYOUT = "bare"
API_KEY_ENV = "SPINE_API_KEY"  # where `spine up --layout bare` reads its key, as vLLM reads VLLM_API_KEY
_OPEN_SERVICES = ("/grpc.health.v1.", "/grpc.reflection.")  # probes and tools need no key


def bearer_ok(metadata: Any, key: str | None) -> bool:
    """Whether a call's metadata carries `authorization: Bearer <key>` (always, without a key)."""
    if key is None:
        return True
    for name, value in metadata or ():
        if name == "authorization" and isinstance(value, str) and value.startswith("Bearer "):
            return hmac.compare_digest(value[len("Bearer "):].encode(), key.encode())
    return False


class BareModel:
    """The HTTP API's target when the model is alone: the Gateway servicer's call shape
    (`Generate`, `GenerateStream`), answered by the inference servicer after the key and the
    model's name are checked."""

    def __init__(self, servicer: Any, names: Mapping[str, str], api_key: str | None) -> None:
        self.servicer = servicer
        self.names = dict(names)  # every id and alias -> the model id
        self.api_key = api_key

    def _admit(self, request: generation_pb2.GenerateRequest, context: Any) -> generation_pb2.GenerateRequest:
        if not bearer_ok(context.invocation_metadata(), self.api_key):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "a missing or wrong API key: send Authorization: Bearer KEY")
        model = self.names.get(request.model)
        if model is None:
            known = ", ".join(sorted(self.names)) or "none"
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown model {request.model[:64]!r}; known: {known}")
            raise AssertionError("context.abort returned")
        if model != request.model:
            resolved = generation_pb2.GenerateRequest()
            resolved.CopyFrom(request)
            resolved.model = model
            return resolved
        return request

    def Generate(self, request: generation_pb2.GenerateRequest, context: Any) -> generation_pb2.GenerateResponse:
        return self.servicer.Generate(self._admit(request, context), ClientContext(context))  # type: ignore[no-any-return]

    def GenerateStream(self, request: generation_pb2.GenerateRequest,
                       context: Any) -> Iterator[generation_pb2.GenerateChunk]:
        yield from self.servicer.GenerateStream(self._admit(request, context), ClientContext(context))


class ClientContext:
    """A client's call context as the model may read it: without `x-spine-*` metadata, which
    only the spine's own gateway sets on its calls to the model (e.g. the tenant whose queue a
    request joins): a client of the bare server cannot claim one."""

    def __init__(self, context: Any) -> None:
        self._context = context

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return tuple((key, value) for key, value in self._context.invocation_metadata() or ()
                     if not key.startswith("x-spine-"))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)


class ApiKeyInterceptor(Interceptor):
    """Refuses every rpc but health and reflection without `authorization: Bearer <key>`."""

    def __init__(self, key: str) -> None:
        self.key = key

    def intercept_service(self, continuation: Callable[[Any], Any], details: Any) -> Any:
        handler = continuation(details)
        if handler is None or details.method.startswith(_OPEN_SERVICES) or bearer_ok(details.invocation_metadata,
                                                                                       self.key):
            return handler

        def refuse(request: Any, context: Any) -> Any:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "a missing or wrong API key: send authorization: Bearer KEY")

        def refuse_stream(request: Any, context: Any) -> Iterator[Any]:
            refuse(request, context)
            yield from ()

        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(refuse_stream, handler.request_deserializer,
                                                        handler.response_serializer)
        return grpc.unary_unary_rpc_method_handler(refuse, handler.request_deserializer, handler.response_serializer)


def served_names(router: RouterConfig, served: Sequence[str]) -> dict[str, str]:
    """Every id and alias of the router's models that the inference component serves -> its id
    (a model served but not routed is reachable by its id)."""
    names = {model_id: model_id for model_id in served}
    for model in router.models:
        if model.id in served:
            for alias in model.aliases:
                names.setdefault(alias, model.id)
    return names


class BareServer:
    """The inference component alone, behind its gRPC service and the HTTP API."""

    def __init__(self, config: SpineConfig, *, listen: str, http_listen: str | None,
                 run_dir: Path | None = None, api_key: str | None = None, tls: Any = None,
                 allow_external: bool = False, probe_listen: str | None = None) -> None:
        self.config = config
        self.listen = listen
        self.http_listen = http_listen
        self.api_key = api_key or None
        self.tls = tls
        self.allow_external = allow_external
        self.probe_listen = probe_listen
        self._tmp: Any = None
        if run_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="spine-bare-")
            run_dir = Path(self._tmp.name)
        run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.run_dir = run_dir
        self.servicer: Any = None
        self.server: Any = None
        self.deep: Any = None
        self.metrics: Any = None
        self.http_server: Any = None
        self._http_app: Any = None

    @property
    def address(self) -> str:
        return str(self.server.address)

    @property
    def http_address(self) -> str | None:
        return None if self.http_server is None else str(self.http_server.address)

    def start(self) -> BareServer:
        from monolith.device_on_use import DeviceOnFirstUse
        from runtime.health.deep import start_deep_health
        from runtime.observability.serving_metrics_export import serve_inference_metrics
        from runtime.server import default_interceptors, request_pool, request_threads, start_server
        from services.registry import DEFAULT

        spec = DEFAULT["inference"]
        try:
            device = DeviceOnFirstUse(self.config.device)
            self.servicer = spec.build(self.config, device, self.run_dir)
            if "torch" in sys.modules:
                device.make_now()
            interceptors = None
            if self.api_key is not None:
                interceptors = [*default_interceptors(), ApiKeyInterceptor(self.api_key)]
            self.server = start_server([(spec, self.servicer)], self.listen,
                                       max_message_bytes=self.config.limits.max_message_bytes,
                                       allow_external=self.allow_external, tls=self.tls,
                                       probe_listen=self.probe_listen, interceptors=interceptors,
                                       **request_pool(self.config.inference))
            inference = self.config.inference
            self.deep = start_deep_health(self.server, self.servicer, inference.health_interval_s,
                                          inference.health_timeout_s, services=["", spec.full_name])
            self.metrics = serve_inference_metrics(self.servicer, self.config, self.run_dir)
            if self.http_listen is not None:
                from runtime.http.server import start_http

                served = self.servicer.served_ids()
                target = BareModel(self.servicer, served_names(self.config.router, served), self.api_key)
                config = self.config
                self.http_server, self._http_app = start_http(
                    target, config.http, config.router, config.limits, request_threads(config.inference),
                    self.http_listen, layout=lambda: BARE_LAYOUT,
                    serving=lambda: self.deep is not None and self.deep.serving is True, tls=self.tls,
                    allow_external=self.allow_external)
        except BaseException:
            self.stop()
            raise
        log.info("the model alone serving on %s (HTTP %s)", self.server.address, self.http_address)
        return self

    def stop(self, grace: float = 3.0) -> None:
        """Finish in-flight requests (HTTP first, then gRPC), then stop the model."""
        if self.http_server is not None:
            self.http_server.stop(grace)
            self.http_server = None
        if self._http_app is not None:
            self._http_app.close()
            self._http_app = None
        if self.deep is not None:
            self.deep.stop()
            self.deep = None
        if self.server is not None:
            self.server.stop(grace)
            self.server = None
        if self.metrics is not None:
            self.metrics.stop()
            self.metrics = None
        if self.servicer is not None:
            from services.registry import close_servicer

            close_servicer(self.servicer)
            self.servicer = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> BareServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
