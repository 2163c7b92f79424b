"""The repository speaks of itself: no code, doc or docstring leans on words that only make
sense to whoever wrote it (a project brief, an architecture map kept elsewhere and the paths
to it, the planning rounds it was written in, a tracker's issue numbers, the people who planned
the work). A reader of the repository has none of those;
the text must say what the thing is instead. A random `seed` is a word of the code and fine,
and so is a citation of another project's tracker (`py-spy issue #480`).
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# Written by a build or a run, or not ours.
SKIPPED_DIRS = {".git", ".venv", ".venv-engine", "wire", "__pycache__", ".cache", "node_modules", ".pytest_cache", ".mypy_cache",
                ".ruff_cache", ".hypothesis"}
SUFFIXES = {".py", ".md", ".yaml", ".yml", ".toml", ".proto", ".sh", ".js", ".html", ".css", ".json", ".txt", ".cfg"}
# Spelled in pieces so that this file does not find itself.
WORDS = re.compile("|".join([
    r"\bthe " + r"seeds?\b", r"\bseed" + r"'s\b", r"\bthe " + r"card\b", r"\bsession " + r"notes\b",
    r"\bthe " + r"lead\b", r"\bissue " + r"[0-9]+",
    # A path out of the checkout (a sibling folder of notes) and the planning rounds of a map.
    r"\.\./" + r"shared\b", r"\bround " + r"[0-9]+(?![.0-9])",
]), re.IGNORECASE)


def repository_text_files() -> list[Path]:
    files = []
    for path in REPO.rglob("*"):
        parts = path.relative_to(REPO).parts
        if any(part in SKIPPED_DIRS for part in parts[:-1]) or not path.is_file():
            continue
        if path.suffix in SUFFIXES or path.name in ("Makefile", "Containerfile"):
            files.append(path)
    return files


def test_no_text_leans_on_words_from_outside_the_repository() -> None:
    found = []
    for path in repository_text_files():
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            match = WORDS.search(line.replace("_", " "))  # a test's name spells its words with underscores
            if match:
                found.append(f"{path.relative_to(REPO)}:{number}: {match.group(0)!r}")
    assert not found, "say what the thing is instead:\n" + "\n".join(found)


def test_the_check_finds_each_word() -> None:
    for text in ["as t" + "he seed says", "t" + "he card's table", "in the sess" + "ion notes", "ask the l" + "ead",
                 "see iss" + "ue 42", "the se" + "ed's header", "def test_is_t" + "he_seeds_error",
                 "kept as `../sh" + "ared/DESIGN.md`", "an HTTP API (rou" + "nd 3 of the map)"]:
        assert WORDS.search(text.replace("_", " ")), text
    assert not WORDS.search("a random seed=5; the leader; the leads; seeded")
    assert not WORDS.search("round 3.14159 to 2 places; a round trip; services/common/shared.py")


# One word for one thing: a "stage" is a migration stage; a piece of the request path
# (auth, rate limit, cache, logs) is a "step". The request path's packages never say "stage".
REQUEST_PATH = ("services/pipeline", "services/gateway", "monolith/batched_pipeline.py", "monolith/batcher.py")
STAGE = re.compile(r"\bstages?\b", re.IGNORECASE)


def test_the_request_path_calls_its_pieces_steps_not_stages() -> None:
    found = []
    for root in REQUEST_PATH:
        for path in sorted((REPO / root).rglob("*.py")) if (REPO / root).is_dir() else [REPO / root]:
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if STAGE.search(line.replace("_", " ")):
                    found.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert not found, "a piece of the request path is a step (a stage is a migration's):\n" + "\n".join(found)
