"""The one tree sampler (`spine.tools.tree_sampler`): a tree's figures sum its children, and
peaks are kept per name and per label."""

from __future__ import annotations

import sys
from pathlib import Path

from runtime.processes.launch import launch
from spine.tools.tree_sampler import TreeSampler, memory_rollup, tree_cpu_seconds, tree_rss_bytes

# A parent that starts a child holding 64 MiB, then says it is ready; both sleep.
TREE = ("import json, subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'b = bytearray(64 << 20); import time; time.sleep(60)'])\n"
        "time.sleep(0.5)\n"
        "print(json.dumps({'event': 'ready', 'address': 'x', 'child': child.pid}), flush=True)\n"
        "time.sleep(60)\n")


def test_a_tree_counts_its_children_and_the_peak_is_kept_per_label(tmp_path: Path) -> None:
    tree = launch("tree", [sys.executable, "-c", TREE], log_path=tmp_path / "tree.log")
    try:
        ready = tree.wait_ready(30)
        child_rss = memory_rollup(int(ready["child"]))["rss_kb"] * 1024
        assert child_rss >= 64 << 20
        assert tree_rss_bytes(tree.pid) > child_rss  # the parent's own pages on top
        assert tree_cpu_seconds(tree.pid) > 0
        sampler = TreeSampler({"tree": tree.pid, "again": tree.pid}, interval_s=0.05).start()
        sampler.measuring("tree", "round-1")
        sampler.measuring("tree", None)
        sampler.stop()
        assert sampler.peak_rss["tree"] >= child_rss and sampler.peak_rss["again"] >= child_rss
        assert sampler.peak_by_label["round-1"] >= child_rss
        assert sampler.peak_device == {"tree": None, "again": None}  # not asked for
    finally:
        tree.stop(5)
    assert tree.alive_pids() == []
