"""The binding classes are written out from the protos, and the file on disk is current."""

from __future__ import annotations

from runtime import binding_codegen
from runtime.binding_classes import LocalAuthBinding, RemoteRateLimitBinding, local_binding, remote_binding
from runtime.bindings import LocalBinding
from services.registry import DEFAULT


def test_the_checked_in_binding_classes_are_what_the_generator_writes() -> None:
    assert binding_codegen.TARGET.read_text() == binding_codegen.render(), \
        "runtime/binding_classes.py is stale: run .venv/bin/python -m runtime.binding_codegen"


def test_every_rpc_of_every_component_is_a_method_of_its_binding_class() -> None:
    for spec in DEFAULT:
        service = spec.descriptor()
        for cls in (local_binding(service), remote_binding(service)):
            assert cls is not LocalBinding
            missing = [method.name for method in service.methods if method.name not in vars(cls.__mro__[1])]
            assert not missing, (cls.__name__, missing)
    assert local_binding(DEFAULT["auth"].descriptor()) is LocalAuthBinding
    assert remote_binding(DEFAULT["ratelimit"].descriptor()) is RemoteRateLimitBinding
