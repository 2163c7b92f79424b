"""YAML to plain data, remembering the line of every key and list item.

Operators edit plans and configs by hand; an error that says `stages[2].spine_weight
(line 14)` sends them to the line. PyYAML's constructed objects forget their marks, so this
walks the composed node tree and records `path -> line` beside the plain data. Duplicate
keys (which PyYAML silently resolves to the last one) are reported instead of guessed at:
raised at the first one, or (`strict=False`) all collected so a config check can list
every problem at once.

Used by the migration plans and by `runtime.config.file`; it lives in the lowest layer that
needs it so neither has to import the other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import yaml


class YamlSourceError(ValueError):
    """The text is not YAML, or not plain data; carries the line."""

    def __init__(self, message: str, line: int, path: str = "") -> None:
        super().__init__(message)
        self.line = line
        self.path = path


@dataclass
class LocatedData:
    """Plain data (dicts, lists, scalars) plus the 1-based line of each path."""

    data: Any
    lines: dict[str, int] = field(default_factory=dict)
    # (path, line) of every repeated key after its first occurrence; the first value is kept.
    duplicates: list[tuple[str, int]] = field(default_factory=list)

    def line(self, path: str) -> int:
        """The line of `path`, or of its nearest recorded ancestor (1 for the root)."""
        while path:
            if path in self.lines:
                return self.lines[path]
            path = parent_path(path)
        return self.lines.get("", 1)


def parent_path(path: str) -> str:
    """`a.b[0].c` -> `a.b[0]` -> `a.b` -> `a` -> `` (the root)."""
    cut = max(path.rfind("."), path.rfind("["))
    return path[:cut] if cut > 0 else ""


def load_located(text: str, *, strict: bool = True) -> LocatedData:
    """Parse one YAML document; raise YamlSourceError naming the line on bad input.

    `strict=False` records duplicate keys in `duplicates` instead of raising at the first.
    """
    loader = yaml.SafeLoader(text)
    try:
        try:
            node = loader.get_single_node()
        except yaml.MarkedYAMLError as exc:
            mark = exc.problem_mark or exc.context_mark
            line = mark.line + 1 if mark is not None else 1
            raise YamlSourceError(f"not valid YAML: {exc.problem or exc}", line) from None
        except yaml.YAMLError as exc:
            raise YamlSourceError(f"not valid YAML: {exc}", 1) from None
        located = LocatedData(None)
        if node is None:
            return located
        located.lines[""] = node.start_mark.line + 1
        located.data = _convert(loader, node, "", located)
        if strict and located.duplicates:
            path, line = located.duplicates[0]
            raise YamlSourceError("duplicate key", line, path)
        return located
    finally:
        loader.dispose()


def _convert(loader: yaml.SafeLoader, node: yaml.Node, path: str, located: LocatedData) -> Any:
    lines = located.lines
    if isinstance(node, yaml.MappingNode):
        out: dict[str, Any] = {}
        for key_node, value_node in node.value:
            line = key_node.start_mark.line + 1
            key = _scalar(loader, key_node)
            if not isinstance(key, str):
                raise YamlSourceError(f"keys must be strings, got {key!r}", line, path)
            child = f"{path}.{key}" if path else key
            if key in out:
                located.duplicates.append((child, line))
                continue
            lines[child] = line
            out[key] = _convert(loader, value_node, child, located)
        return out
    if isinstance(node, yaml.SequenceNode):
        items = []
        for index, item in enumerate(node.value):
            child = f"{path}[{index}]"
            lines[child] = item.start_mark.line + 1
            items.append(_convert(loader, item, child, located))
        return items
    return _scalar(loader, node)


def _scalar(loader: yaml.SafeLoader, node: yaml.Node) -> Any:
    try:
        return loader.construct_object(node, deep=True)
    except yaml.constructor.ConstructorError as exc:
        raise YamlSourceError(f"unsupported YAML value: {exc.problem}", node.start_mark.line + 1) from None
