"""The bench's spines differ only in what they batch: checked on the configs they start with."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.regime import write_configs
from bench.report import batching_gain
from bench.targets import LAYOUTS
from runtime.config.file import load_config


def test_each_spine_layout_batches_what_its_name_says(tmp_path: Path) -> None:
    configs = {layout: load_config(path) for layout, path in write_configs(tmp_path).items()}
    assert set(configs) == set(LAYOUTS)
    default_model_batch = configs["collapsed"].inference.max_batch
    assert default_model_batch > 1
    assert configs["collapsed"].batching.enabled is True
    # the batcher off end to end: middleware per request and one sequence per model step
    assert configs["collapsed-unbatched"].batching.enabled is False
    assert configs["collapsed-unbatched"].inference.max_batch == 1
    # only the middleware batcher off: the model batches exactly as in the batched spine and bare
    assert configs["collapsed-middleware-unbatched"].batching.enabled is False
    assert configs["collapsed-middleware-unbatched"].inference == configs["collapsed"].inference
    assert configs["bare"].inference == configs["collapsed"].inference


def test_batching_gain_compares_the_batched_spine_with_the_named_unbatched_one() -> None:
    def run(layout: str, rps: float) -> dict:
        return {"mode": "unary", "concurrency": 64, "layout": layout, "rps": rps, "p50_ms": 1000 / rps,
                "p99_ms": 2000 / rps}

    runs = [run("collapsed", 400.0), run("collapsed-unbatched", 100.0), run("collapsed-middleware-unbatched", 320.0)]
    assert batching_gain(runs)[0]["batched_over_unbatched_rps"] == 4.0
    assert batching_gain(runs, "collapsed-middleware-unbatched")[0]["batched_over_unbatched_rps"] == 1.25
    assert batching_gain(runs[:1]) == []


def test_bench_on_a_model_directory_serves_it_in_every_layout(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from bench.settings import parse_args
    from spine.tools.model.make_tiny import make_tiny

    model = make_tiny(tmp_path / "tiny-llama")
    settings, _, _ = parse_args(["--quick", "--model", str(model)])
    assert settings.model == str(model) and settings.model_id == "tiny-llama"
    configs = {layout: load_config(path)
               for layout, path in write_configs(tmp_path, settings.model, settings.model_id).items()}
    for layout, config in configs.items():
        assert config.inference.model_id == "tiny-llama", layout
        assert config.inference.backend.spec() == {"class": "hf", "options": {"path": str(model.resolve())}}, layout
        assert [(m.id, m.backend, m.aliases) for m in config.router.models] == [("tiny-llama", "inference", ("default",))]
    assert configs["collapsed-unbatched"].inference.max_batch == 1


def test_a_one_client_cell_is_cut_into_short_rounds_unless_rounds_are_given() -> None:
    """At concurrency 1 a layout's turn lasts ~40 requests, so a slow spell of the host lands
    on every layout alike; cells with many clients keep their few long rounds."""
    from bench.settings import SEQUENTIAL_BUDGET_S, SEQUENTIAL_REQUESTS, SEQUENTIAL_ROUND, parse_args

    settings, _, _ = parse_args([])
    one = settings.cell_requests(1)
    assert one == SEQUENTIAL_REQUESTS
    assert settings.cell_rounds(1, one) == one // SEQUENTIAL_ROUND
    assert settings.cell_rounds(64, settings.cell_requests(64)) == settings.rounds
    given, _, _ = parse_args(["--rounds", "3", "--requests", "900"])
    assert given.cell_requests(1) == 900 and given.cell_rounds(1, 900) == 3
    quick, _, _ = parse_args(["--quick"])
    assert quick.cell_rounds(1, quick.cell_requests(1)) == quick.rounds
    # The one-client cell's time limit grows with its requests (a slow layout is not cut
    # short); cells with many clients keep the flat limit.
    assert settings.cell_limit_s(1, one) == one * SEQUENTIAL_BUDGET_S > settings.cell_time_limit_s
    assert settings.cell_limit_s(64, settings.cell_requests(64)) == settings.cell_time_limit_s


def test_a_cell_with_many_clients_has_enough_requests_for_seconds_of_load() -> None:
    """16 clients at 25 requests each were a quarter second a turn: too short against the
    host's slow spells. Every concurrent cell gets at least CONCURRENT_REQUESTS, more where
    25 a worker is more; --requests still sets the count."""
    from bench.settings import CONCURRENT_REQUESTS, REQUESTS_PER_WORKER, parse_args

    settings, _, _ = parse_args([])
    assert settings.cell_requests(16) == CONCURRENT_REQUESTS > REQUESTS_PER_WORKER * 16
    assert settings.cell_requests(256) == REQUESTS_PER_WORKER * 256 > CONCURRENT_REQUESTS
    given, _, _ = parse_args(["--requests", "300"])
    assert given.cell_requests(16) == 300
