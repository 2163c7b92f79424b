"""A serving process freezes what it made while starting: full collections skip it, and
what it makes later is still collected, cycles included (`monolith.runtime_env`)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_startup_heap_is_frozen_and_later_garbage_is_still_collected() -> None:
    # A fresh interpreter: a server's start, measured from its beginning (the runner's own heap
    # is frozen once collection ends: tests/conftest.py).
    script = textwrap.dedent("""
        import gc, json, weakref
        import runtime.stack  # a server's imports: grpc, protobuf, pydantic, the registry
        from monolith.runtime_env import freeze_startup_heap
        before = len(gc.get_objects())
        frozen = freeze_startup_heap()
        after = len(gc.get_objects())

        class Node:
            pass

        node = Node()
        node.self = node  # a cycle: only the cyclic collector can free it
        gone = weakref.ref(node)
        del node
        gc.collect()
        print(json.dumps({"before": before, "frozen": frozen, "after": after, "cycle_freed": gone() is None}))
    """)
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120,
                         check=True)
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["before"] > 10_000, seen  # what a full collection used to walk
    assert seen["frozen"] >= seen["before"] // 2, seen  # moved out of the generations (less the garbage)
    assert seen["after"] < 1_000, seen  # what is left for a full collection
    assert seen["cycle_freed"], "a cycle made after the freeze was not collected"
