"""The docs point at files that exist: every repository path a page names in backticks, every
relative link and every `#anchor` it links to. A rename that leaves a page pointing nowhere
fails here, not in a newcomer's hands."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = sorted([REPO / "README.md", REPO / "bench" / "README.md", REPO / "deploy" / "README.md",
                REPO / "deploy" / "RUNBOOK.md", *(REPO / "docs").glob("*.md")])
# Written by a build or a run, never committed.
GENERATED = {"wire/v1", "wire/v1/", "bench/results.json", "bench/results.png", "bench/results-capacity.png",
             "bench/profile.svg", "bench/leases.json", "bench/real_model.json", "bench/image.json", ".cache/models/smollm2-135m-instruct"}
TOP = ("services/", "runtime/", "monolith/", "migration/", "spine/", "bench/", "deploy/", "docs/", "protos/",
       "tests/", "wire/", ".ci/")
SUFFIXES = (".py", ".md", ".yaml", ".yml", ".json", ".proto", ".sh", ".toml")
PLACEHOLDER = re.compile(r"[<>*{}$|=]|DIR|PATH|HOST|NAME")


def named_paths(page: Path) -> list[str]:
    """Backticked tokens that are repository paths (a top-level package's folder, or a file)."""
    out = []
    for token in re.findall(r"`([^`\s]+)`", page.read_text()):
        token = token.rstrip(".,:;)")
        if PLACEHOLDER.search(token) or token.startswith(("http", "unix:", "/", "-", "xds:", "../")):
            continue
        if token.startswith(TOP) or ("/" in token and token.endswith(SUFFIXES)):
            out.append(token)
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(REPO)))
def test_every_path_a_page_names_exists(page: Path) -> None:
    missing = [token for token in named_paths(page)
               if token not in GENERATED and not (REPO / token).exists() and not (page.parent / token).exists()]
    assert not missing, f"{page.relative_to(REPO)} names paths that do not exist: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(REPO)))
def test_every_relative_link_and_anchor_resolves(page: Path) -> None:
    broken = []
    for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]+))?\)", page.read_text()):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        linked = page.parent / target if target else page
        if not linked.exists():
            broken.append(target)
        elif anchor and linked.suffix == ".md":
            headings = {slug(h) for h in re.findall(r"^#+ (.*)$", linked.read_text(), re.M)}
            if anchor not in headings:
                broken.append(f"{target}#{anchor}")
    assert not broken, f"{page.relative_to(REPO)} links to what does not exist: {broken}"


def test_the_readme_fits_on_a_few_screens() -> None:
    assert len((REPO / "README.md").read_text().splitlines()) <= 250


def test_the_config_reference_names_every_section() -> None:
    from runtime.config.model import root_model

    page = (REPO / "docs" / "config.md").read_text()
    documented = set(re.findall(r"^\| `([a-z_]+)` \|", page, re.M))
    assert set(root_model().model_fields) <= documented, "docs/config.md lacks a section of the config"


def test_the_cli_reference_names_every_command() -> None:
    import subprocess
    import sys

    usage = subprocess.run([sys.executable, "-m", "spine", "--help"], capture_output=True, text=True, check=True,
                           cwd=REPO).stdout
    commands = re.search(r"\{([a-z,-]+)\}", usage)
    assert commands is not None, usage
    page = (REPO / "docs" / "cli.md").read_text()
    missing = [name for name in commands.group(1).split(",") if f"`spine {name}" not in page]
    assert not missing, f"docs/cli.md does not document: {missing}"
