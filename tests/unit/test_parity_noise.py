"""The parity gate's noise: only what the baseline (layered) disagrees with itself on, and
only where a difference started, not every field it showed in.

`make run` once promoted a spine faulted to sample: a calibration copy that hit the spine
twice found it disagreeing with itself on `tokens`, `tokens` became noise, and every token
mismatch against the layered answers was excused."""

from __future__ import annotations

from migration.metrics.parity import ShadowCounts, add_sample, parity_stats
from migration.metrics.promql import mismatched_query
from runtime.shadow.decisions import Decision, differing, root_differences
from runtime.shadow.metrics import COMPARED, MISMATCHED
from runtime.shadow.traffic import ShadowConfig, ShadowMirror


def _window(calibration_primary: str) -> tuple[ShadowCounts, ShadowCounts]:
    window = add_sample(ShadowCounts(), COMPARED, {"calibration": "false", "primary": "layered", "shadow": "spine"}, 20)
    window = add_sample(window, MISMATCHED, {"calibration": "false", "field": "tokens", "primary": "layered",
                                             "shadow": "spine"}, 13)
    noise = add_sample(ShadowCounts(), MISMATCHED, {"calibration": "true", "field": "tokens",
                                                    "primary": calibration_primary, "shadow": calibration_primary}, 1)
    return window, noise


def test_the_baseline_disagreeing_with_itself_makes_a_field_noise() -> None:
    window, noise = _window("layered")
    stats = parity_stats(window, noise.noise)
    assert stats.noisy_fields == ("tokens",) and stats.mismatches == 0


def test_a_spine_disagreeing_with_itself_excuses_nothing() -> None:
    window, noise = _window("spine")
    stats = parity_stats(window, noise.noise)
    assert stats.noisy_fields == () and stats.mismatches == 13


def test_prometheus_reads_the_baselines_calibration_only() -> None:
    assert 'primary="layered"' in mismatched_query("", "30s", calibration=True)
    assert "primary" not in mismatched_query("", "30s", calibration=False)


# -- a difference and its consequences -------------------------------------------------------

def _answered(tokens: tuple[int, ...] = (1, 2), model: str = "tiny-lm") -> Decision:
    return Decision("OK", "", "passed", "passed", model, False, tokens)


LIMITED = Decision("RESOURCE_EXHAUSTED", "rate limited by tenant=dev,model=tiny-lm,resource=requests; retry after <t>",
                   "passed", "limited", "", False, None)
INVALID = Decision("INVALID_ARGUMENT", "max_tokens: must be at most 256", "passed", "passed", "", False, None)
DENIED = Decision("UNAUTHENTICATED", "unknown API key", "denied", "passed", "", False, None)


def test_a_difference_is_counted_where_it_started_not_where_it_showed() -> None:
    assert differing(LIMITED, _answered()) == ("status", "details", "ratelimit", "route", "tokens")
    assert root_differences(LIMITED, _answered()) == ("ratelimit",)
    assert root_differences(DENIED, LIMITED) == ("auth",)
    assert root_differences(INVALID, _answered()) == ("status",)
    assert root_differences(_answered(model="a"), _answered((3,), model="b")) == ("route",)
    assert root_differences(_answered((1, 2)), _answered((1, 3))) == ("tokens",)
    # a pair explained by an ignored difference differs in nothing
    assert root_differences(LIMITED, _answered(), ignore=("ratelimit",)) == ()
    assert root_differences(_answered((1,)), _answered((2,)), ignore=("cached",)) == ("tokens",)


def test_a_tenant_at_its_limit_does_not_excuse_a_spine_answering_other_tokens() -> None:
    """At its limit a copy is limited or not by timing: the baseline's calibration pairs
    disagree on `ratelimit`. That must not make `tokens` noise: it did, and a spine faulted to
    sample was promoted (seen with a test tenant at 40 requests/s)."""
    mirror = ShadowMirror(ShadowConfig(share=1.0, ignore_fields=("cached",)), _unused, key=b"k" * 16)
    mirror.compare("layered", "layered", _answered(), LIMITED, calibration=True)
    mirror.compare("layered", "layered", LIMITED, _answered(), calibration=True)
    for index in range(6):
        mirror.compare("layered", "spine", _answered((1, 2)), _answered((1, 2 + index % 2)))
    mirror.compare("layered", "spine", _answered(), LIMITED)
    assert mirror.noisy_fields() == {"ratelimit"}
    counts = ShadowCounts()
    for family in mirror.counters.collect():
        for sample in family.samples:
            counts = add_sample(counts, sample.name, sample.labels, sample.value)
    mirror.close()
    stats = parity_stats(counts, counts.noise)
    assert stats.noisy_fields == ("ratelimit",)
    assert stats.by_field == {"ratelimit": 1, "tokens": 3} and stats.mismatches == 3


def _unused(*args: object) -> Decision:
    raise AssertionError("no mirror expected")


def test_an_upstreams_answers_without_token_ids_are_compared_by_their_text() -> None:
    """An engine's answer carries text, no ids: two different texts must not look alike."""
    from runtime.shadow.decisions import decide
    from wire.v1 import generation_pb2

    request = generation_pb2.GenerateRequest(model="m", prompt="p", max_tokens=8)
    paris = generation_pb2.GenerateResponse(text="Paris.", model="m")
    lyon = generation_pb2.GenerateResponse(text="Lyon.", model="m")
    assert differing(decide(request, "OK", response=paris), decide(request, "OK", response=lyon)) == ("tokens",)
    streamed = [generation_pb2.GenerateChunk(text="Par", model="m"), generation_pb2.GenerateChunk(text="is.")]
    assert differing(decide(request, "OK", response=paris), decide(request, "OK", chunks=streamed)) == ()
