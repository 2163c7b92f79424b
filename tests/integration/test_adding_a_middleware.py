"""Adding a middleware = its proto, its package (its interface, servicer and step), one table entry.

A throwaway `audit` middleware, defined entirely in this file (its proto is compiled here),
joins the request path of both layouts through one `ComponentSpec`: its config section is
checked, its placement is a knob, its step runs in order, its spans are named, a plan may
move it and its own verdict reaches the client — in the spine through its servicer, across
the wire through the one generic remote proxy, made from its interface's codec.
"""

from __future__ import annotations

import importlib
import shutil
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import grpc
import pytest
from grpc_tools import protoc

from migration.plan import load_plan
from runtime.config.file import SpineConfig, load_config
from runtime.config.model import root_model
from runtime.observability.tracing import span_name
from runtime.running_stack import RunningStack
from runtime.server import start_server
from runtime.stack import Stack
from services.common import ConfigError, DeviceState, set_status, status_code
from services.common.config_section import Items, NonEmptyStr, Section
from services.component import ComponentConfig, ComponentSpec
from services.pipeline.batch_rpc import BatchRpc, ItemError
from services.pipeline.interface import NO_OPTIONS, CallOptions, Interface
from services.pipeline.state import RequestState
from services.pipeline.step import FailMode, Step, StepCall
from services.ratelimit.steps import RateLimitStep
from services.registry import DEFAULT, Registry
from spine.client.gateway_client import GatewayClient
from tests.conftest import DEV_KEY
from wire.v1 import generation_pb2

REPO = Path(__file__).resolve().parents[2]
AUDIT_PROTO = """
syntax = "proto3";
package spinetest.v1;
import "wire/v1/batch.proto";

message SeenRequest { string tenant = 1; string model = 2; }
message SeenResult { spine.v1.ItemStatus status = 1; }
message SeenBatchRequest { repeated SeenRequest items = 1; }
message SeenBatchResponse { repeated SeenResult results = 1; }

service Audit {
  rpc SeenBatch(SeenBatchRequest) returns (SeenBatchResponse);
}
"""


def _compile_audit_proto() -> Any:
    """The proto, compiled as `make protos` compiles the project's own."""
    out = Path(tempfile.mkdtemp(prefix="spine-audit-proto-"))
    (out / "spinetest" / "v1").mkdir(parents=True)
    (out / "spinetest" / "v1" / "audit.proto").write_text(AUDIT_PROTO)
    code = protoc.main(["protoc", f"-I{REPO / 'protos'}", f"-I{out}", f"--python_out={out}",
                        f"--grpc_python_out={out}", "spinetest/v1/audit.proto"])
    assert code == 0, "protoc failed on the audit proto"
    sys.path.insert(0, str(out))
    return importlib.import_module("spinetest.v1.audit_pb2")


audit_pb2 = _compile_audit_proto()


# -- its interface: what its callers see, and how its one operation crosses the wire ----------

@dataclass(slots=True)
class Seen:
    tenant: str
    model: str


class Audit(Protocol):
    def seen(self, items: Sequence[Seen], options: CallOptions = NO_OPTIONS) -> list[ItemError | None]: ...


def _encode_results(results: Sequence[ItemError | None]) -> Any:
    answer = audit_pb2.SeenBatchResponse()
    for result in results:
        item = answer.results.add()
        if result is not None:
            set_status(item.status, result.code, result.message)
    return answer


SEEN_BATCH: BatchRpc[Seen, None, audit_pb2.SeenBatchRequest, audit_pb2.SeenBatchResponse] = BatchRpc(
    rpc="SeenBatch", method="seen",
    encode_items=lambda items: audit_pb2.SeenBatchRequest(
        items=[audit_pb2.SeenRequest(tenant=item.tenant, model=item.model) for item in items]),
    decode_items=lambda request: [Seen(item.tenant, item.model) for item in request.items],
    encode_results=_encode_results,
    decode_results=lambda answer: [ItemError(status_code(result.status.code), result.status.message)
                                   if result.status.code else None for result in answer.results])
AUDIT_API: Interface[Audit] = Interface("audit", [SEEN_BATCH])


# -- the service -------------------------------------------------------------------------------

class AuditSection(Section):
    blocked: Items[NonEmptyStr] = ()  # tenants refused


class AuditService:
    """Remembers who asked for what; refuses blocked tenants (its own verdict, per item)."""

    def __init__(self, config: AuditSection) -> None:
        self.config = config
        self.seen_so_far: list[tuple[str, str]] = []

    def seen(self, items: Sequence[Seen], options: CallOptions = NO_OPTIONS) -> list[ItemError | None]:
        results: list[ItemError | None] = []
        for item in items:
            self.seen_so_far.append((item.tenant, item.model))
            blocked = item.tenant in self.config.blocked
            results.append(ItemError(grpc.StatusCode.PERMISSION_DENIED, f"tenant {item.tenant!r} is blocked by audit")
                           if blocked else None)
        return results

    def SeenBatch(self, request: Any, context: Any = None) -> Any:
        return SEEN_BATCH.serve(self, request, context)


def build(config: ComponentConfig, device: DeviceState, run_dir: Path) -> AuditService:
    section: AuditSection = config.audit  # the section the table entry declares
    return AuditService(section)


class AuditStep(Step[Audit]):
    interface = AUDIT_API
    method = "Seen"

    def decide(self, batch: list[RequestState], call: StepCall[Audit]) -> None:
        results = call.component.seen([Seen(state.tenant, state.model) for state in batch], call.options)
        self.answered(call, batch, results)


# -- the one table entry -------------------------------------------------------------------------

AUDIT = ComponentSpec(
    "audit", "spinetest.v1.audit_pb2", "Audit", build, AuditSection,
    (AuditStep,), FailMode.CLOSED, passes=frozenset({grpc.StatusCode.PERMISSION_DENIED}))
REGISTRY = DEFAULT.with_component(AUDIT, after=RateLimitStep)  # after the rate limit, before the cache


def config_with(audit: dict[str, Any]) -> SpineConfig:
    return load_config(overrides={"audit": audit}, registry=REGISTRY)


def placements(audit: str) -> dict[str, str]:
    return {**dict.fromkeys(DEFAULT.names, "local"), "audit": audit}


@pytest.fixture
def client_of() -> Iterator[Any]:
    stacks: list[RunningStack] = []

    def start(stack: Stack) -> tuple[RunningStack, GatewayClient]:
        running = stack.start()
        stacks.append(running)
        return running, GatewayClient(running.address, token=DEV_KEY)

    yield start
    for stack in stacks:
        stack.stop()


def test_the_table_entry_is_enough_for_config_plans_spans_and_order() -> None:
    assert REGISTRY.middlewares == (*DEFAULT.middlewares, "audit")
    model = root_model(REGISTRY)
    assert "audit" in model.model_fields and "audit" in model.model_fields["placements"].annotation.model_fields
    assert AUDIT.interface is AUDIT_API and span_name("audit", AuditStep.method) == "audit.seen"
    names = [step.name for step in REGISTRY.steps(load_limits())]
    assert names.index("ratelimit.admit") < names.index("audit.seen") < names.index("cache.lookup")
    plan = load_plan("name: p\nstages:\n  - name: audit-local\n    spine_weight: 10\n    hold_s: 1\n"
                     "    placements: {audit: local}\n",
                     REGISTRY.middlewares)
    assert plan.stages[0].placements["audit"] == "local"


def request(prompt: str) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(model="tiny-lm", prompt=prompt, max_tokens=2)


def load_limits() -> Any:
    from services.pipeline.limits import RequestLimits

    return RequestLimits()


def test_a_new_middleware_runs_in_the_spine_and_its_verdict_reaches_the_client(client_of: Any, tmp_path: Path) -> None:
    stack, client = client_of(Stack(config_with({}), placements("local"), run_dir=tmp_path / "open",
                                    registry=REGISTRY))
    result = client.generate(request("audited"))
    assert result.code == grpc.StatusCode.OK
    assert stack.local_servicers["audit"].seen_so_far == [("dev", "tiny-lm")]

    _, blocked = client_of(Stack(config_with({"blocked": ["dev"]}), placements("local"),
                                 run_dir=tmp_path / "blocked", registry=REGISTRY))
    refused = blocked.generate(request("audited"))
    assert refused.code == grpc.StatusCode.PERMISSION_DENIED
    assert refused.details == "tenant 'dev' is blocked by audit"


def test_a_new_middleware_runs_in_its_own_process_too(client_of: Any, tmp_path: Path) -> None:
    servicer = AuditService(AuditSection(blocked=()))
    sock_dir = tempfile.mkdtemp(prefix="spine-audit-", dir="/tmp")
    server = start_server([(AUDIT, servicer)], f"unix:{sock_dir}/audit.sock")
    try:
        stack, client = client_of(Stack(config_with({}), placements("remote"), run_dir=tmp_path / "remote",
                                        registry=REGISTRY, remote_addresses={"audit": server.address}))
        result = client.generate(request("audited over the wire"))
        assert result.code == grpc.StatusCode.OK
        assert servicer.seen_so_far == [("dev", "tiny-lm")]
        assert stack.layout == "mixed"
    finally:
        server.stop(0)
        shutil.rmtree(sock_dir, ignore_errors=True)


def test_its_config_section_is_checked_like_every_other() -> None:
    with pytest.raises(ConfigError, match=r"audit\.blokced: unknown key; known: blocked"):
        config_with({"blokced": ["dev"]})
    assert config_with({"blocked": ["x"]}).model_dump()["audit"] == {"blocked": ("x",)}


def test_a_component_whose_steps_are_not_on_the_path_is_refused() -> None:
    with pytest.raises(ValueError, match=r"missing \['AuditStep'\]"):
        Registry([*DEFAULT, AUDIT], DEFAULT.path)
