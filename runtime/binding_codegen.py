"""Writes `runtime/binding_classes.py`: each component's binding classes, one method per rpc.

A binding has the stub's call shape: `bindings["auth"].Check(request, timeout=…)`. Those
methods are written out, not made at run time, so that go-to-definition follows a call from
its caller to the binding: one class per (component, placement), generated from the protos
of the component table (`services.registry.DEFAULT`). Run after changing a proto or the
table:

    .venv/bin/python -m runtime.binding_codegen

`tests/test_binding_classes.py` fails while the file on disk differs from what this writes.
"""

from __future__ import annotations

import sys
from pathlib import Path

from google.protobuf import descriptor as pb_descriptor

from services.registry import DEFAULT, ComponentSpec, Registry

TARGET = Path(__file__).with_name("binding_classes.py")
KINDS = (("Local", "LocalBinding"), ("Remote", "RemoteBinding"), ("Foreign", "ForeignBinding"))

HEADER = '''"""Each component's binding classes, one method per rpc (GENERATED: do not edit).

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
'''


def _type(message: pb_descriptor.Descriptor, modules: dict[str, str]) -> str:
    module = message.file.name.removesuffix(".proto").replace("/", ".") + "_pb2"
    alias = module.rsplit(".", 1)[1]
    modules[module] = alias
    return f"{alias}.{message.name}"


def _calls(spec: ComponentSpec, modules: dict[str, str]) -> str:
    service = spec.descriptor()
    lines = [f"class {spec.service}Calls(BaseBinding):",
             f'    """`{service.full_name}`\'s rpcs with the stub\'s call shape (`BaseBinding.call`)."""']
    for method in service.methods:
        request = _type(method.input_type, modules)
        answer = "Any" if method.server_streaming else _type(method.output_type, modules)
        note = "  # a stream: iterate it, cancel() it, read its trailing_metadata()" if method.server_streaming else ""
        lines += ["",
                  f"    def {method.name}(self, request: {request}, timeout: float | None = None,",
                  f"            metadata: Metadata | None = None, **options: Any) -> {answer}:{note}",
                  f'        return self.call("{method.name}", request, timeout, metadata, **options)']
    return "\n".join(lines)


def render(registry: Registry = DEFAULT) -> str:
    modules: dict[str, str] = {}
    blocks = []
    for spec in registry:
        blocks.append(_calls(spec, modules))
        camel = spec.service
        for kind, base in KINDS:
            if kind == "Foreign" and not spec.foreign:
                continue
            blocks.append(f"class {kind}{camel}Binding({camel}Calls, {base}):\n"
                          f'    """{spec.name}, {kind.lower()}."""')
    packages: dict[str, list[str]] = {}
    for module, alias in sorted(modules.items()):
        packages.setdefault(module.rsplit(".", 1)[0], []).append(alias)
    imports = "\n".join(f"from {package} import (\n" + "".join(f"    {alias},\n" for alias in aliases) + ")"
                        for package, aliases in sorted(packages.items()))
    tables = []
    for kind, base in KINDS:
        rows = "\n".join(f'    "{spec.descriptor().full_name}": {kind}{spec.service}Binding,' for spec in registry
                         if kind != "Foreign" or spec.foreign)
        tables.append(f"{kind.upper()}: dict[str, type[{base}]] = {{\n{rows}\n}}")
    factories = "\n\n\n".join(
        f"def {kind.lower()}_binding(service: pb_descriptor.ServiceDescriptor) -> type[{base}]:\n"
        f'    """The {kind.lower()} binding class for `service`."""\n'
        f"    return {kind.upper()}.get(service.full_name, {base})"
        for kind, base in KINDS)
    return (HEADER + imports + "\n\n\n" + "\n\n\n".join(blocks) + "\n\n\n"
            + "\n".join(tables) + "\n\n\n" + factories + "\n")


def main() -> None:
    TARGET.write_text(render())
    sys.stdout.write(f"wrote {TARGET}\n")


if __name__ == "__main__":
    main()
