"""Each component's binding classes, one method per rpc (GENERATED: do not edit).

Written by `runtime/binding_codegen.py` from the component table's protos; `local_binding`,
`remote_binding` and `foreign_binding` pick the class for a component's service (a component
the table does not know, e.g. one a test adds, gets the plain binding: `call`, `invoke` and
`call_batch` by name).
"""

from __future__ import annotations

from typing import Any

from google.protobuf import descriptor as pb_descriptor

from runtime.bindings import BaseBinding, LocalBinding, Metadata
from runtime.foreign import ForeignBinding
from runtime.remote_binding import RemoteBinding
from wire.v1 import (
    auth_pb2,
    cache_pb2,
    generation_pb2,
    inference_pb2,
    logs_pb2,
    metrics_pb2,
    ratelimit_pb2,
    router_pb2,
)


class AuthCalls(BaseBinding):
    """`spine.v1.Auth`'s rpcs with the stub's call shape (`BaseBinding.call`)."""

    def Check(self, request: auth_pb2.CheckRequest, timeout: float | None = None,
            metadata: Metadata | None = None, **options: Any) -> auth_pb2.CheckResponse:
        return self.call("Check", request, timeout, metadata, **options)

    def CheckBatch(self, request: auth_pb2.CheckBatchRequest, timeout: float | None = None,
            metadata: Metadata | None = None, **options: Any) -> auth_pb2.CheckBatchResponse:
        return self.call("CheckBatch", request, timeout, metadata, **options)


class LocalAuthBinding(AuthCalls, LocalBinding):
    """auth, local."""


class RemoteAuthBinding(AuthCalls, RemoteBinding):
    """auth, remote."""


class ForeignAuthBinding(AuthCalls, ForeignBinding):
    """auth, foreign."""


class RateLimitCalls(BaseBinding):
    """`spine.v1.RateLimit`'s rpcs with the stub's call shape (`BaseBinding.call`)."""

    def ShouldRateLimit(self, request: ratelimit_pb2.RateLimitRequest, timeout: float | None = None,
            metadata: Metadata | None = None, **options: Any) -> ratelimit_pb2.RateLimitResponse:
        return self.call("ShouldRateLimit", request, timeout, metadata, **options)

    def SetShare(self, request: ratelimit_pb2.SetShareRequest, timeout: float | None = None,
            metadata: Metadata | None = None, **options: Any) -> ratelimit_pb2.SetShareResponse:
        return self.call("SetShare", request, timeout, metadata, **options)

    def Admit(self, request: ratelimit_pb2.AdmitRequest, timeout: float | None = None,
            metadata: Metadata | None = None, **options: Any) -> ratelimit_pb2.AdmitResponse:
        return self.call("Admit", request, timeout, metadata, **options)

    def AdmitBatch(self, request: ratelimit_pb2.AdmitBatchRequest, timeout: float | None = None,
            metadata: Metadata | None = None, **options: Any) -> ratelimit_pb2.AdmitBatchResponse:
        return self.call("AdmitBatch", request, timeout, metadata, **options)

    def Release(self, request: ratelimit_pb2.ReleaseRequest, timeout: float | None = None,
            metadata: Metadata | None = None, **options: Any) -> ratelimit_pb2.ReleaseResponse:
        return self.call("Release", request, timeout, metadata, **options)

    def ReleaseBatch(self, request: ratelimit_pb2.ReleaseBatchRequest, timeout: float | None = None,
            metadata: Metadata | None = None, **options: Any) -> ratelimit_pb2.ReleaseBatchResponse:
        return self.call("ReleaseBatch", request, timeout, metadata, **options)


class LocalRateLimitBinding(RateLimitCalls, LocalBinding):
    """ratelimit, local."""


class RemoteRateLimitBinding(RateLimitCalls, RemoteBinding):
    """ratelimit, remote."""


class ForeignRateLimitBinding(RateLimitCalls, ForeignBinding):
    """ratelimit, foreign."""


class RouterCalls(BaseBinding):
    """`spine.v1.Router`'s rpcs with the stub's call shape (`BaseBinding.call`)."""

    def Resolve(self, request: router_pb2.ResolveRequest, timeout: float | None = None,
            metadata: Metadata | None = None, **options: Any) -> router_pb2.ResolveResponse:
        return self.call("Resolve", request, timeout, metadata, **options)

    def ListModels(self, request: router_pb2.ListModelsRequest, timeout: float | None = None,
            metadata: Metadata | None = None, **options: Any) -> router_pb2.ListModelsResponse:
        return self.call("ListModels", request, timeout, metadata, **options)

    def ResolveBatch(self, request: router_pb2.ResolveBatchRequest, timeout: float | None = None,
            metadata: Metadata | None = None, **options: Any) -> router_pb2.ResolveBatchResponse:
        return self.call("ResolveBatch", request, timeout, metadata, **options)


class LocalRouterBinding(RouterCalls, LocalBinding):
    """router, local."""


class RemoteRouterBinding(RouterCalls, RemoteBinding):
    """router, remote."""


class CacheCalls(BaseBinding):
    """`spine.v1.Cache`'s rpcs with the stub's call shape (`BaseBinding.call`)."""

    def Lookup(self, request: cache_pb2.CacheLookupRequest, timeout: float | None = None,
            metadata: Metadata | None = None, **options: Any) -> cache_pb2.CacheLookupResponse:
        return self.call("Lookup", request, timeout, metadata, **options)

    def Store(self, request: cache_pb2.CacheStoreRequest, timeout: float | None = None,
            metadata: Metadata | None = None, **options: Any) -> cache_pb2.CacheStoreResponse:
        return self.call("Store", request, timeout, metadata, **options)

    def Stats(self, request: cache_pb2.CacheStatsRequest, timeout: float | None = None,
            metadata: Metadata | None = None, **options: Any) -> cache_pb2.CacheStatsResponse:
        return self.call("Stats", request, timeout, metadata, **options)

    def LookupBatch(self, request: cache_pb2.CacheLookupBatchRequest, timeout: float | None = None,
            metadata: Metadata | None = None, **options: Any) -> cache_pb2.CacheLookupBatchResponse:
        return self.call("LookupBatch", request, timeout, metadata, **options)

    def StoreBatch(self, request: cache_pb2.CacheStoreBatchRequest, timeout: float | None = None,
            metadata: Metadata | None = None, **options: Any) -> cache_pb2.CacheStoreBatchResponse:
        return self.call("StoreBatch", request, timeout, metadata, **options)


class LocalCacheBinding(CacheCalls, LocalBinding):
    """cache, local."""


class RemoteCacheBinding(CacheCalls, RemoteBinding):
    """cache, remote."""


class MetricsCalls(BaseBinding):
    """`spine.v1.Metrics`'s rpcs with the stub's call shape (`BaseBinding.call`)."""

    def Record(self, request: metrics_pb2.RequestRecord, timeout: float | None = None,
            metadata: Metadata | None = None, **options: Any) -> metrics_pb2.RecordResponse:
        return self.call("Record", request, timeout, metadata, **options)

    def Scrape(self, request: metrics_pb2.ScrapeRequest, timeout: float | None = None,
            metadata: Metadata | None = None, **options: Any) -> metrics_pb2.ScrapeResponse:
        return self.call("Scrape", request, timeout, metadata, **options)

    def RecordBatch(self, request: metrics_pb2.RecordBatchRequest, timeout: float | None = None,
            metadata: Metadata | None = None, **options: Any) -> metrics_pb2.RecordBatchResponse:
        return self.call("RecordBatch", request, timeout, metadata, **options)


class LocalMetricsBinding(MetricsCalls, LocalBinding):
    """metrics, local."""


class RemoteMetricsBinding(MetricsCalls, RemoteBinding):
    """metrics, remote."""


class LogsCalls(BaseBinding):
    """`spine.v1.Logs`'s rpcs with the stub's call shape (`BaseBinding.call`)."""

    def Append(self, request: logs_pb2.LogRecord, timeout: float | None = None,
            metadata: Metadata | None = None, **options: Any) -> logs_pb2.AppendResponse:
        return self.call("Append", request, timeout, metadata, **options)

    def Flush(self, request: logs_pb2.FlushRequest, timeout: float | None = None,
            metadata: Metadata | None = None, **options: Any) -> logs_pb2.FlushResponse:
        return self.call("Flush", request, timeout, metadata, **options)

    def AppendBatch(self, request: logs_pb2.AppendBatchRequest, timeout: float | None = None,
            metadata: Metadata | None = None, **options: Any) -> logs_pb2.AppendBatchResponse:
        return self.call("AppendBatch", request, timeout, metadata, **options)


class LocalLogsBinding(LogsCalls, LocalBinding):
    """logs, local."""


class RemoteLogsBinding(LogsCalls, RemoteBinding):
    """logs, remote."""


class InferenceCalls(BaseBinding):
    """`spine.v1.Inference`'s rpcs with the stub's call shape (`BaseBinding.call`)."""

    def Generate(self, request: generation_pb2.GenerateRequest, timeout: float | None = None,
            metadata: Metadata | None = None, **options: Any) -> generation_pb2.GenerateResponse:
        return self.call("Generate", request, timeout, metadata, **options)

    def GenerateStream(self, request: generation_pb2.GenerateRequest, timeout: float | None = None,
            metadata: Metadata | None = None, **options: Any) -> Any:  # a stream: iterate it, cancel() it, read its trailing_metadata()
        return self.call("GenerateStream", request, timeout, metadata, **options)

    def Models(self, request: inference_pb2.ModelInfoRequest, timeout: float | None = None,
            metadata: Metadata | None = None, **options: Any) -> inference_pb2.ModelInfoResponse:
        return self.call("Models", request, timeout, metadata, **options)


class LocalInferenceBinding(InferenceCalls, LocalBinding):
    """inference, local."""


class RemoteInferenceBinding(InferenceCalls, RemoteBinding):
    """inference, remote."""


LOCAL: dict[str, type[LocalBinding]] = {
    "spine.v1.Auth": LocalAuthBinding,
    "spine.v1.RateLimit": LocalRateLimitBinding,
    "spine.v1.Router": LocalRouterBinding,
    "spine.v1.Cache": LocalCacheBinding,
    "spine.v1.Metrics": LocalMetricsBinding,
    "spine.v1.Logs": LocalLogsBinding,
    "spine.v1.Inference": LocalInferenceBinding,
}
REMOTE: dict[str, type[RemoteBinding]] = {
    "spine.v1.Auth": RemoteAuthBinding,
    "spine.v1.RateLimit": RemoteRateLimitBinding,
    "spine.v1.Router": RemoteRouterBinding,
    "spine.v1.Cache": RemoteCacheBinding,
    "spine.v1.Metrics": RemoteMetricsBinding,
    "spine.v1.Logs": RemoteLogsBinding,
    "spine.v1.Inference": RemoteInferenceBinding,
}
FOREIGN: dict[str, type[ForeignBinding]] = {
    "spine.v1.Auth": ForeignAuthBinding,
    "spine.v1.RateLimit": ForeignRateLimitBinding,
}


def local_binding(service: pb_descriptor.ServiceDescriptor) -> type[LocalBinding]:
    """The local binding class for `service`."""
    return LOCAL.get(service.full_name, LocalBinding)


def remote_binding(service: pb_descriptor.ServiceDescriptor) -> type[RemoteBinding]:
    """The remote binding class for `service`."""
    return REMOTE.get(service.full_name, RemoteBinding)


def foreign_binding(service: pb_descriptor.ServiceDescriptor) -> type[ForeignBinding]:
    """The foreign binding class for `service`."""
    return FOREIGN.get(service.full_name, ForeignBinding)
