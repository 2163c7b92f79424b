"""The Router service: ids and aliases to backends, through a real gRPC server and `resolve`."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from services.common import ConfigError
from services.router.config import RouterConfig
from services.router.service import RouterService
from tests.batch_of_one import one
from tests.conftest import served
from wire.v1 import router_pb2, router_pb2_grpc

SECTION: dict[str, Any] = {
    "models": [
        {"id": "tiny-lm", "backend": "inference", "aliases": ["default", "tiny"]},
        {"id": "big-lm", "backend": "gpu-pool"},
    ]
}
KNOWN = "tiny-lm (aliases: default, tiny); big-lm"


@pytest.fixture
def service() -> RouterService:
    return RouterService(RouterConfig.parse(SECTION))


@pytest.fixture
def stub(service: RouterService) -> Iterator[router_pb2_grpc.RouterStub]:
    with served("router", service) as router_stub:
        yield router_stub


def resolve(stub: router_pb2_grpc.RouterStub, model: str) -> router_pb2.ResolveResponse:
    return one(stub.ResolveBatch(router_pb2.ResolveBatchRequest(items=[router_pb2.ResolveRequest(model=model)]),
                                 timeout=10))


def not_found(stub: router_pb2_grpc.RouterStub, model: str) -> str:
    with pytest.raises(grpc.RpcError) as info:
        resolve(stub, model)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    return info.value.details() or ""


def test_alias_resolves_to_its_model_and_backend(stub: router_pb2_grpc.RouterStub) -> None:
    response = resolve(stub, "tiny")
    assert (response.model_id, response.backend, response.requested) == ("tiny-lm", "inference", "tiny")


def test_id_resolves_to_itself(stub: router_pb2_grpc.RouterStub) -> None:
    response = resolve(stub, "big-lm")
    assert (response.model_id, response.backend, response.requested) == ("big-lm", "gpu-pool", "big-lm")


def test_unknown_model_is_not_found_naming_the_known_ones(stub: router_pb2_grpc.RouterStub) -> None:
    assert not_found(stub, "gpt-9") == f"unknown model 'gpt-9'; known: {KNOWN}"


def test_empty_model_is_not_found(stub: router_pb2_grpc.RouterStub) -> None:
    assert not_found(stub, "") == f"no model requested; known: {KNOWN}"


def test_names_are_case_sensitive(stub: router_pb2_grpc.RouterStub) -> None:
    assert not_found(stub, "Tiny").startswith("unknown model 'Tiny'")


def test_a_very_long_unknown_name_is_quoted_only_in_part(stub: router_pb2_grpc.RouterStub) -> None:
    details = not_found(stub, "x" * 5000)
    assert "x" * 64 + "..." in details and "x" * 65 not in details


def test_list_models_returns_ids_and_aliases(stub: router_pb2_grpc.RouterStub) -> None:
    response = stub.ListModels(router_pb2.ListModelsRequest(), timeout=10)
    assert list(response.model_ids) == ["tiny-lm", "big-lm"]
    assert dict(response.aliases) == {"default": "tiny-lm", "tiny": "tiny-lm"}


def test_resolve_raises_lookup_error_for_the_batcher(service: RouterService) -> None:
    with pytest.raises(LookupError, match="unknown model 'nope'"):
        service.route("nope")
    assert service.route("default").model_id == "tiny-lm"


def test_default_config_router_section_parses() -> None:
    config = yaml.safe_load(Path("runtime/default_config.yaml").read_text())
    service = RouterService(RouterConfig.parse(config["router"]))
    assert service.route("default").model_id == "tiny-lm"


def _config_error(models: Any) -> str:
    with pytest.raises(ConfigError) as info:
        RouterConfig.parse({"models": models})
    return str(info.value)


def test_duplicate_model_id_is_a_config_error() -> None:
    message = _config_error([{"id": "a", "backend": "b"}, {"id": "a", "backend": "c"}])
    assert message == "router.models[1].id: 'a' is already used by router.models[0].id"


def test_duplicate_alias_is_a_config_error() -> None:
    message = _config_error(
        [{"id": "a", "backend": "b", "aliases": ["x"]}, {"id": "c", "backend": "b", "aliases": ["x"]}]
    )
    assert message == "router.models[1].aliases[0]: 'x' is already used by router.models[0].aliases[0]"


def test_alias_equal_to_another_models_id_is_a_config_error() -> None:
    message = _config_error([{"id": "a", "backend": "b", "aliases": ["c"]}, {"id": "c", "backend": "b"}])
    assert message == "router.models[0].aliases[0]: 'c' is already used by router.models[1].id"


def test_empty_model_id_is_a_config_error() -> None:
    assert _config_error([{"id": "", "backend": "b"}]) == "router.models[0].id: expected a non-empty string, got ''"


def test_missing_backend_is_a_config_error() -> None:
    assert _config_error([{"id": "a"}]).startswith("router.models[0].backend:")


def test_empty_alias_is_a_config_error() -> None:
    assert _config_error([{"id": "a", "backend": "b", "aliases": [""]}]).startswith("router.models[0].aliases[0]:")


def test_no_models_is_a_config_error() -> None:
    assert _config_error([]).startswith("router.models: expected a non-empty list")


def test_misspelled_field_is_a_config_error() -> None:
    message = _config_error([{"id": "a", "backend": "b", "alias": ["x"]}])
    assert message.startswith("router.models[0].alias: unknown key; known: id, backend, aliases")


def test_an_upstream_model_needs_no_backend_and_resolves_to_the_inference_component() -> None:
    config = RouterConfig.parse({"models": [
        {"id": "a", "backend": "inference"},
        {"id": "up", "aliases": ["u"], "upstream": {"base_url": "http://127.0.0.1:8001/v1/", "fallbacks": ["b"]}},
        {"id": "b", "upstream": {"base_url": "https://models.internal/v1", "protocol": "anthropic"}}]})
    assert config.models[1].upstream is not None and config.models[1].upstream.base_url == "http://127.0.0.1:8001/v1"
    assert RouterService(config).route("u").backend == "inference"


@pytest.mark.parametrize(("model", "expected"), [
    ({"id": "x"}, "router.models[0].backend: give `backend: inference` or an `upstream:"),
    ({"id": "x", "backend": "elsewhere", "upstream": {"base_url": "http://h/v1"}}, "leave `backend` out"),
    ({"id": "x", "upstream": {"base_url": "ftp://h/v1"}}, "router.models[0].upstream.base_url: expected http(s)"),
    ({"id": "x", "upstream": {"base_url": "http://user:pw@h/v1"}}, "the key goes in api_key_file"),
    ({"id": "x", "upstream": {"base_url": "http://h/v1", "protocol": "grpc"}}, "router.models[0].upstream.protocol"),
    ({"id": "x", "upstream": {"base_url": "http://h/v1", "fallbacks": ["tiny"]}},
     "router.models[0].upstream.fallbacks[0]: 'tiny' is not served by an upstream"),
    ({"id": "x", "upstream": {"base_url": "http://h/v1", "context_fallback": "nope"}},
     "router.models[0].upstream.context_fallback: 'nope' is not a model id or alias"),
])
def test_a_bad_upstream_block_is_a_config_error(model: dict, expected: str) -> None:
    message = _config_error([model, {"id": "tiny", "backend": "inference"}])
    assert expected in message, message
