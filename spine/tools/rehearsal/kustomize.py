"""Render a kustomization of deploy/k8s in Python: `render(Path("deploy/k8s/layered"))`.

deploy/k8s's kustomizations only list `resources:` (files and other kustomizations), which this
renders as kustomize does: each resource once, in order, depth first. Anything else in a
kustomization (patches, generators, images, ...) is refused by name, so a kustomization that
grows one must be rendered by kustomize itself (`kubectl kustomize`; the tests compare the two
where kubectl is installed).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

KUSTOMIZATION_NAMES = ("kustomization.yaml", "kustomization.yml", "Kustomization")
UNDERSTOOD = {"apiVersion", "kind", "resources"}


class KustomizeError(ValueError):
    pass


def kustomization_file(directory: Path) -> Path:
    for name in KUSTOMIZATION_NAMES:
        if (directory / name).is_file():
            return directory / name
    raise KustomizeError(f"{directory}: no kustomization file")


def render(directory: Path, _seen: set[Path] | None = None) -> list[dict[str, Any]]:
    """Every object the kustomization at `directory` builds, each resource directory once."""
    seen = set() if _seen is None else _seen
    directory = directory.resolve()
    if directory in seen:
        return []
    seen.add(directory)
    path = kustomization_file(directory)
    kustomization = yaml.safe_load(path.read_text()) or {}
    unknown = sorted(set(kustomization) - UNDERSTOOD)
    if unknown:
        raise KustomizeError(f"{path}: {', '.join(unknown)} is beyond this renderer (resources only): use kustomize")
    objects: list[dict[str, Any]] = []
    for resource in kustomization.get("resources") or []:
        target = (directory / resource).resolve()
        if target.is_dir():
            objects += render(target, seen)
        else:
            objects += [doc for doc in yaml.safe_load_all(target.read_text()) if doc]
    return objects
