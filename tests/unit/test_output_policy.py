"""The output policy: rules from config, compiled once, per tenant and model; whole answers and
stream windows; the classifier hook; config problems named."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from runtime.config.file import load_config
from services.common import ConfigError
from services.inference.output_policy import VIOLATION, OutputPolicy, OutputPolicyConfig

CLASSIFIED: list[tuple[str, tuple[int, ...]]] = []


def flags_token_seven(text: str, token_ids: Sequence[int]) -> bool:
    """A classifier for the hook: sees the text and its token ids."""
    CLASSIFIED.append((text, tuple(token_ids)))
    return 7 in token_ids


def policy(*rules: dict[str, object], window_chars: int = 16) -> OutputPolicy:
    return OutputPolicy(OutputPolicyConfig.model_validate({"rules": list(rules), "window_chars": window_chars}))


def test_a_phrase_or_pattern_anywhere_in_an_answer_is_a_violation_named_by_its_rule() -> None:
    checks = policy({"name": "words", "phrases": ["Secret Plan"], "patterns": [r"\bAKIA[0-9A-Z]{4}\b"]})
    found = checks.check("dev", "tiny-lm", "here is the secret plan, in full", [])
    assert found is not None and found.rule == "words"
    assert found.details.startswith(VIOLATION) and "secret plan" not in found.details.lower()
    assert checks.check("dev", "tiny-lm", "key AKIAABCD here", []) is not None
    assert checks.check("dev", "tiny-lm", "key AKIAABCDE here", []) is None  # the pattern's word boundary
    assert checks.check("dev", "tiny-lm", "nothing to see", []) is None


def test_phrases_are_text_not_expressions_and_case_sensitive_on_request() -> None:
    checks = policy({"name": "dots", "phrases": ["a.b"], "case_sensitive": True})
    assert checks.check("dev", "m", "axb", []) is None
    assert checks.check("dev", "m", "A.B", []) is None
    assert checks.check("dev", "m", "a.b", []) is not None


def test_a_rule_applies_only_to_the_tenants_and_models_it_names() -> None:
    checks = policy({"name": "free", "phrases": ["bad"], "tenants": ["free-org"]},
                    {"name": "mini", "phrases": ["worse"], "models": ["tiny-lm-mini"]})
    assert checks.check("free-org", "tiny-lm", "bad", []) is not None
    assert checks.check("pro-org", "tiny-lm", "bad", []) is None
    assert checks.check("pro-org", "tiny-lm-mini", "worse", []) is not None
    assert checks.check("pro-org", "tiny-lm", "worse", []) is None
    assert checks.stream("pro-org", "tiny-lm") is None  # no rule applies: nothing to check


def test_a_stream_is_checked_over_a_window_so_a_phrase_split_across_chunks_is_caught() -> None:
    stream = policy({"name": "split", "phrases": ["forbidden"]}).stream("dev", "tiny-lm")
    assert stream is not None
    assert stream.check("this is for", []) is None
    assert stream.check("bid", []) is None
    found = stream.check("den fruit", [])
    assert found is not None and found.rule == "split"


def test_the_window_keeps_only_the_last_characters() -> None:
    stream = policy({"name": "p", "patterns": ["start.*end"]}, window_chars=16).stream("dev", "m")
    assert stream is not None
    assert stream.check("start" + "x" * 20, []) is None
    assert stream.check("end", []) is None  # "start" has left the 16-character window


def test_a_classifier_hook_sees_the_text_and_the_token_ids() -> None:
    CLASSIFIED.clear()
    checks = policy({"name": "clf", "classifier": f"{__name__}:flags_token_seven"})
    assert checks.check("dev", "m", "fine", [1, 2]) is None
    found = checks.check("dev", "m", "also fine", [3, 7])
    assert found is not None and found.kind == "classifier"
    assert CLASSIFIED == [("fine", (1, 2)), ("also fine", (3, 7))]


def test_a_classifier_that_cannot_be_imported_is_a_config_error_naming_the_rule() -> None:
    with pytest.raises(ConfigError, match=r"output_policy.rules\[0\].classifier"):
        policy({"name": "gone", "classifier": "tests.no_such_module:judge"})


def test_a_bad_regular_expression_is_refused_with_its_path() -> None:
    with pytest.raises(ConfigError, match=r"output_policy.rules\[0\].patterns\[1\]: not a regular expression"):
        load_config(overrides={"output_policy": {"rules": [{"name": "r", "patterns": ["ok", "(unclosed"]}]}})


def test_the_default_config_has_no_policy() -> None:
    assert OutputPolicy.of(load_config().output_policy) is None


def test_a_streams_classifier_sees_the_windows_token_ids() -> None:
    CLASSIFIED.clear()
    stream = policy({"name": "clf", "classifier": f"{__name__}:flags_token_seven"}).stream("dev", "m")
    assert stream is not None
    assert stream.check("a", [1]) is None
    found = stream.check("b", [7])
    assert found is not None and found.kind == "classifier"
    assert CLASSIFIED == [("a", (1,)), ("ab", (1, 7))]
