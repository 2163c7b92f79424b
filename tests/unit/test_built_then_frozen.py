"""Parts are constructed complete: no module outside the tests sets another object's attribute.

A layout's parts (the gateway, the pipeline, the components, the front, ...) get what they
need when they are made; nothing reaches into one afterwards and rewires it
(`gateway.admission = ...`, `pipeline.barriers[...] = ...`). What changes while a layout runs
changes through a method of the object that owns it (`Placed.swap`, `Front.set_weight`).
Read by this test from the code itself (an AST walk), so a new rewiring fails here, naming
its line.

Allowed: an object's own attributes (`self.x = ...`), objects a function made itself (its
locals, its loop variables), private parts an object made itself (`self._rows = _Rows()`,
then `self._rows.capacity = ...`: its own state, kept in a helper no one else is handed),
and data records — a protobuf message, a dataclass (a
request's state, a child's record) — whose fields are what they hold. A parameter or an
attribute of `self` is judged by its annotation; a library object whose API is attribute
assignment (uvicorn's server, an `ssl.SSLContext`) is named in `LIBRARY_OBJECTS`.

A dataclass that holds running parts (a field whose type is something that stops or closes:
a server, a process, a thread) is not a data record: what it holds was started, and is not
swapped from outside any more than a part's own wiring is. A builder returns such a record
made whole and frozen (`Stack.start() -> RunningStack`, `Cutover.start() -> RunningCutover`).
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("services", "runtime", "migration", "monolith", "spine", "bench")
# Third-party objects configured by setting attributes (their documented API), by the annotation naming them.
LIBRARY_OBJECTS = {"uvicorn.Server", "uvicorn.Config", "ssl.SSLContext", "RequestResponseCycle", "ServerState",
                   "H11Protocol", "HttpToolsProtocol"}
# Library types that run until stopped: a field of one makes a dataclass hold a running part.
LIBRARY_RUNNING = {"Popen", "Thread", "Server", "ExitStack", "ThreadPoolExecutor"}


def _source_files() -> list[Path]:
    return sorted(path for package in PACKAGES for path in (REPO / package).rglob("*.py"))


def _classes() -> list[ast.ClassDef]:
    return [node for path in _source_files() for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.ClassDef)]


def _is_dataclass(node: ast.ClassDef) -> bool:
    return any("dataclass" in ast.unparse(decorator) for decorator in node.decorator_list)


def _words(annotation: str) -> set[str]:
    """The names in an annotation, each without its module (`grpc.Server | None` -> Server, None)."""
    for mark in "[]|,\"":
        annotation = annotation.replace(mark, " ")
    return {word.split(".")[-1] for word in annotation.split()}


def _running_parts(classes: list[ast.ClassDef]) -> set[str]:
    """The repository's classes of things that run until stopped (they have `stop`, `close`
    or `__exit__`), and the library's (`LIBRARY_RUNNING`)."""
    return LIBRARY_RUNNING | {node.name for node in classes if {
        item.name for item in node.body if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef)}
        & {"stop", "close", "__exit__"}}


def _holds_running_parts(node: ast.ClassDef, running: set[str]) -> bool:
    return any(isinstance(item, ast.AnnAssign) and _words(ast.unparse(item.annotation)) & running
               for item in node.body)


def _dataclasses() -> set[str]:
    """The repository's data records: its dataclasses, less those that hold running parts."""
    classes = _classes()
    running = _running_parts(classes)
    return {node.name for node in classes if _is_dataclass(node) and not _holds_running_parts(node, running)}


def _own(target: ast.expr) -> bool:
    """`self.<attr>`."""
    return isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self"


def _root(node: ast.expr) -> str:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else ""


def _is_record(annotation: str | None, records: set[str]) -> bool:
    if annotation is None:
        return False
    words = {word for word in annotation.replace("[", " ").replace("]", " ").replace("|", " ").replace(",", " ")
             .replace('"', " ").split()}
    return any("_pb2." in word or word.split(".")[-1] in records or word in LIBRARY_OBJECTS for word in words)


class _Rewirings(ast.NodeVisitor):
    """Assignments to another object's attribute, in one module."""

    def __init__(self, path: Path, records: set[str]) -> None:
        self.path = path
        self.records = records
        self.found: list[str] = []
        self._classes: list[dict[str, str | None]] = []  # each enclosing class: its attributes' annotations
        self._parts: list[set[str]] = []  # each enclosing class: the attributes it made itself (a call)
        # (parameters, locals, each alias's root name) per function
        self._scopes: list[tuple[dict[str, str | None], set[str], dict[str, str]]] = []
        self._current: ast.AST | None = None  # the function being read

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        annotations: dict[str, str | None] = {}
        parts: set[str] = set()
        passed: set[str] = set()  # attributes ever set from a parameter or another object: not made here
        for item in ast.walk(node):
            if isinstance(item, ast.AnnAssign):
                target = item.target
                if isinstance(target, ast.Name):
                    annotations[target.id] = ast.unparse(item.annotation)
                elif _own(target):
                    annotations[target.attr] = ast.unparse(item.annotation)  # type: ignore[union-attr]
            elif isinstance(item, ast.Assign) and isinstance(item.value, ast.Call):
                for target in item.targets:  # `self.stats = BatchStats()`: its type is what made it
                    if _own(target):
                        annotations.setdefault(target.attr, ast.unparse(item.value.func))  # type: ignore[union-attr]
                        parts.add(target.attr)  # type: ignore[union-attr]
            elif isinstance(item, ast.Assign | ast.AnnAssign) and item.value is not None:
                for target in item.targets if isinstance(item, ast.Assign) else [item.target]:
                    if _own(target):
                        passed.add(target.attr)  # type: ignore[union-attr]
        self._classes.append(annotations)
        self._parts.append({name for name in parts - passed if name.startswith("_")})
        self.generic_visit(node)
        self._classes.pop()
        self._parts.pop()

    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> None:
        arguments = node.args
        parameters = {arg.arg: (ast.unparse(arg.annotation) if getattr(arg, "annotation", None) else None)
                      for arg in [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]}
        made: set[str] = set()
        aliases: set[str] = set()
        roots: dict[str, str] = {}  # an alias: the name its object is reached from
        for item in ast.walk(node):
            if isinstance(item, ast.Assign):  # `gateway = self.gateway` is the same object, not a new one
                for target in item.targets:
                    values = item.value.elts if isinstance(item.value, ast.Tuple) else [item.value]
                    names = target.elts if isinstance(target, ast.Tuple) else [target]
                    for name, value in zip(names, values, strict=False):
                        if isinstance(name, ast.Name) and isinstance(value, ast.Name | ast.Attribute):
                            aliases.add(name.id)
                            roots[name.id] = _root(value)
            if isinstance(item, ast.Name) and isinstance(item.ctx, ast.Store):
                made.add(item.id)
        own = made - set(parameters) - aliases
        # A part of an object made here (`principal = verdict.principal`) is made here too.
        own |= {name for name in aliases if roots.get(name) in own}
        self._scopes.append((parameters, own, roots))
        outer, self._current = self._current, node
        self.generic_visit(node)
        self._current = outer
        self._scopes.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function  # type: ignore[assignment]

    def _aliased(self, name: str) -> bool:
        """Whether `name` is, in this function, another name for an object it did not make."""
        if not self._scopes:
            return False
        parameters, made, _ = self._scopes[-1]
        return name not in made and name not in parameters and self._bound_here(name)

    def _bound_here(self, name: str) -> bool:
        return self._current is not None and any(
            isinstance(item, ast.Name) and item.id == name and isinstance(item.ctx, ast.Store)
            for item in ast.walk(self._current))

    def visit_Assign(self, node: ast.Assign) -> None:
        for target in node.targets:
            self._judge(target, node.lineno)
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self._judge(node.target, node.lineno)
        self.generic_visit(node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self._judge(node.target, node.lineno)
        self.generic_visit(node)

    def visit_Delete(self, node: ast.Delete) -> None:
        for target in node.targets:
            self._judge(target, node.lineno)
        self.generic_visit(node)

    def _judge(self, target: ast.expr, line: int) -> None:
        if isinstance(target, ast.Tuple | ast.List):
            for element in target.elts:
                self._judge(element, line)
            return
        if isinstance(target, ast.Subscript):  # x.y[k] = v: a change to x's attribute y
            target = target.value
        if not isinstance(target, ast.Attribute):
            return
        held = target.value  # whose attribute is set
        if isinstance(held, ast.Name):
            if held.id in ("self", "cls"):
                return  # its own
            parameters, made, roots = self._scopes[-1] if self._scopes else ({}, set(), {})
            if held.id in made:
                return  # an object this function made
            if held.id in parameters and _is_record(parameters[held.id], self.records):
                return
            root = roots.get(held.id)  # `call = state.model_call`: a part of a record is a record
            if root in parameters and _is_record(parameters[root], self.records):
                return
            if held.id not in parameters and not self._aliased(held.id):
                return  # a module, a global record: not a part of a layout
        elif isinstance(held, ast.Attribute) and isinstance(held.value, ast.Name) and held.value.id == "self":
            annotation = self._classes[-1].get(held.attr) if self._classes else None
            if _is_record(annotation, self.records) or (self._parts and held.attr in self._parts[-1]):
                return
        else:
            return  # deeper chains are read, not rewired, by the code this checks
        self.found.append(f"{self.path.relative_to(REPO)}:{line}: {ast.unparse(target)}")


def test_no_module_sets_another_objects_attribute_after_construction() -> None:
    records = _dataclasses()
    found: list[str] = []
    for path in _source_files():
        visitor = _Rewirings(path, records)
        visitor.visit(ast.parse(path.read_text()))
        found += visitor.found
    assert not found, "an object is rewired after it was made; hand it what it needs when it is made, " \
                      "or change it through a method of its own:\n" + "\n".join(found)


def test_the_check_finds_a_rewiring() -> None:
    code = ("class Stack:\n"
            "    def start(self, gateway: Gateway) -> None:\n"
            "        gateway.admission = self.batching\n"
            "        self.pipeline.barriers['x'] = None\n"
            "        self.own = 1\n"
            "        self.gateway = Gateway()\n"
            "        self.gateway.layout = 'mixed'\n"
            "        self._rows = Rows()\n"
            "        self._rows.capacity = 2\n"
            "        pipeline = self.pipeline\n"
            "        pipeline.clients = {}\n"
            "        answer = Response()\n"
            "        answer.text = 'ok'\n")
    visitor = _Rewirings(REPO / "x.py", set())
    visitor.visit(ast.parse(code))
    assert [line.split(": ", 1)[1] for line in visitor.found] == ["gateway.admission", "self.pipeline.barriers",
                                                                  "self.gateway.layout",
                                                                  "pipeline.clients"]


def test_a_dataclass_that_holds_running_parts_is_no_data_record() -> None:
    """Its fields are parts that were started (a front, a process), not what it holds as data:
    setting one from outside is a rewiring like any other."""
    records = _dataclasses()
    assert {"RunningStack", "RunningCutover", "RunningLegacyCutover", "Child", "RunningServer"}.isdisjoint(records)
    assert {"Exit", "ReleaseItem"} <= records  # records of data
    code = ("class Supervisor:\n"
            "    def restart(self, child: Child, process: Popen) -> None:\n"
            "        child.process = process\n"
            "        child.exits.append(1)\n")
    visitor = _Rewirings(REPO / "x.py", records)
    visitor.visit(ast.parse(code))
    assert [line.split(": ", 1)[1] for line in visitor.found] == ["child.process"]
