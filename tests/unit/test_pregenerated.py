"""The pre-generated answer table: its file, its lookups, refusing bad files, swapping files,
and answers identical to the model's (a property test against the real model)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.cache.config import CacheConfig
from services.cache.pregenerated import PregeneratedTable, TableError, served_digests, table_key, write_table
from services.cache.pregenerated_answers import PregeneratedAnswers
from services.cache.service import CacheService
from services.inference.config import InferenceConfig
from services.pipeline.local_context import LocalContext
from spine.tools.model.cache_build import PromptLine, answer_prompts
from tests.conftest import config_for_tests
from tests.waiting import ManualClock, eventually
from wire.v1 import generation_pb2

pytestmark = pytest.mark.usefixtures("torch_one_thread")

CONFIG = config_for_tests()
DIGESTS = served_digests(CONFIG.inference)


def answer(text: str, tokens: list[int]) -> generation_pb2.GenerateResponse:
    return generation_pb2.GenerateResponse(text=text, token_ids=tokens, model="tiny-lm", finish_reason="length",
                                           prompt_tokens=3, completion_tokens=len(tokens), system_digest="ab")


def greedy(prompt: str, max_tokens: int = 4, system: str = "", **fields: Any) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(model="tiny-lm", prompt=prompt, max_tokens=max_tokens, system=system,
                                          **fields)


def small_table(path: Path, count: int = 50, text: str = "answer") -> Path:
    write_table(path, "tiny-lm", DIGESTS["tiny-lm"],
                ((table_key("tiny-lm", "", f"p{i}", 4), answer(f"{text} {i}", [i, i + 1])) for i in range(count)))
    return path


def test_a_written_table_maps_back_every_answer_and_misses_the_rest(tmp_path: Path) -> None:
    table = PregeneratedTable(small_table(tmp_path / "t.bin", 200), DIGESTS)
    try:
        assert (table.model_id, table.entries) == ("tiny-lm", 200)
        for i in range(200):
            assert table.lookup(table_key("tiny-lm", "", f"p{i}", 4)) == answer(f"answer {i}", [i, i + 1])
        assert table.lookup(table_key("tiny-lm", "", "p1", 5)) is None  # another max_tokens
        assert table.lookup(table_key("tiny-lm", "sys", "p1", 4)) is None  # another system prompt
        assert table.lookup(table_key("tiny-lm-mini", "", "p1", 4)) is None
    finally:
        table.close()


@pytest.mark.parametrize("damage", ["truncated", "corrupt", "not-a-table", "wrong-model", "other-weights"])
def test_a_bad_table_is_refused_with_one_log_line_and_served_without(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: str) -> None:
    path = small_table(tmp_path / "t.bin")
    data = bytearray(path.read_bytes())
    if damage == "truncated":
        path.write_bytes(data[: len(data) - 7])
    elif damage == "corrupt":
        data[-3] ^= 0xFF
        path.write_bytes(data)
    elif damage == "not-a-table":
        path.write_bytes(b"{}" * 400)
    elif damage == "wrong-model":
        write_table(path, "gpt-9", b"\0" * 32, [(table_key("gpt-9", "", "p0", 4), answer("x", [1]))])
    else:
        write_table(path, "tiny-lm", b"\1" * 32, [(table_key("tiny-lm", "", "p0", 4), answer("x", [1]))])
    with caplog.at_level(logging.INFO, logger="spine.cache"):
        answers = PregeneratedAnswers(path, DIGESTS)
        assert answers.table is None
        assert answers.lookup(greedy("p0")) is None
    refused = [r for r in caplog.records if "refused" in r.getMessage()]
    assert len(refused) == 1 and refused[0].levelno == logging.ERROR
    assert str(path) in refused[0].getMessage()
    with pytest.raises(TableError):
        PregeneratedTable(path, DIGESTS)


def test_only_greedy_requests_of_the_tables_model_are_answered(tmp_path: Path) -> None:
    answers = PregeneratedAnswers(small_table(tmp_path / "t.bin"), DIGESTS)
    assert answers.lookup(greedy("p3")) == answer("answer 3", [3, 4])
    assert answers.lookup(greedy("p3", seed=5)) == answer("answer 3", [3, 4])  # greedy: a seed changes nothing
    assert answers.lookup(greedy("p3", temperature=0.7, seed=5)) is None
    assert answers.lookup(generation_pb2.GenerateRequest(model="tiny-lm-mini", prompt="p3", max_tokens=4)) is None


def test_a_replaced_file_is_swapped_in_without_a_lookup_going_unanswered(tmp_path: Path) -> None:
    path = small_table(tmp_path / "t.bin", text="old")
    clock = ManualClock()
    answers = PregeneratedAnswers(path, DIGESTS, check_every_s=1.0, clock=clock)
    stop = threading.Event()
    missed: list[str] = []

    def lookups() -> None:  # every lookup in flight during the swap gets one table's answer
        while not stop.is_set():
            found = answers.lookup(greedy("p7"))
            if found is None or found.text not in ("old 7", "new 7"):
                missed.append(repr(found))

    threads = [threading.Thread(target=lookups) for _ in range(2)]
    for thread in threads:
        thread.start()
    try:
        small_table(path, text="new")  # written beside it, then renamed over it
        assert answers.lookup(greedy("p7")).text == "old 7"  # type: ignore[union-attr]  # not checked yet
        clock.advance(1.5)
        eventually(lambda: (answers.lookup(greedy("p7")) or answer("", [])).text == "new 7", what="the swap")
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    assert missed == [] and answers.swaps == 1


def test_a_bad_replacement_keeps_the_table_it_had(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = small_table(tmp_path / "t.bin")
    clock = ManualClock()
    answers = PregeneratedAnswers(path, DIGESTS, check_every_s=1.0, clock=clock)
    broken = tmp_path / "broken.bin"
    broken.write_bytes(path.read_bytes()[:-10])
    broken.replace(path)
    with caplog.at_level(logging.ERROR, logger="spine.cache"):
        clock.advance(1.5)
        answers.lookup(greedy("p1"))
        eventually(lambda: any("keeping the previous table" in r.getMessage() for r in caplog.records))
    assert answers.lookup(greedy("p1")) == answer("answer 1", [1, 2]) and answers.swaps == 0


def test_the_cache_answers_from_the_table_before_its_own_index_and_counts_it(tmp_path: Path) -> None:
    from monolith.device import DeviceContext

    device = DeviceContext.for_section(CONFIG.device)
    service = CacheService(CacheConfig(), device, pregenerated=PregeneratedAnswers(small_table(tmp_path / "t.bin"),
                                                                                   DIGESTS))
    probes = service.lookup([("dev", greedy("p2")), ("other", greedy("p2")), ("dev", greedy("unknown"))])
    hits = [probe.hit for probe in probes]  # type: ignore[union-attr]
    assert hits[0] == hits[1] and hits[0] is not None and hits[0].cached and hits[0].text == "answer 2"
    assert [probe.pregenerated for probe in probes] == [True, True, False]  # type: ignore[union-attr]
    assert hits[2] is None and service.pregenerated_hits == 2


# -- identical to the model --------------------------------------------------------------------

@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Any]]:
    """The table's builder (deterministic mode, as `spine cache build`) and a server's model
    (the test config as a server runs it)."""
    from monolith.device import DeviceContext
    from services.registry import DEFAULT

    tmp = tmp_path_factory.mktemp("models")
    deterministic = CONFIG.with_overrides({"inference": {"deterministic": True}})
    builder = DEFAULT["inference"].build(deterministic, DeviceContext.for_section(CONFIG.device), tmp)
    server = DEFAULT["inference"].build(CONFIG, DeviceContext.for_section(CONFIG.device), tmp)
    try:
        yield builder, server
    finally:
        builder.close()
        server.close()


texts = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=24)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lines=st.lists(st.tuples(texts, texts.filter(str.strip), st.integers(1, 12)), min_size=1, max_size=4))
def test_a_tables_answer_is_the_models_own(models: tuple[Any, Any], tmp_path: Path,
                                           lines: list[tuple[str, str, int]]) -> None:
    builder, server = models
    prompts = [PromptLine("tiny-lm", system, prompt, max_tokens) for system, prompt, max_tokens in lines]
    path = tmp_path / "property.bin"
    write_table(path, "tiny-lm", DIGESTS["tiny-lm"], answer_prompts(builder, "tiny-lm", prompts))
    table = PregeneratedAnswers(path, DIGESTS)
    for line in prompts:
        request = greedy(line.prompt, line.max_tokens, line.system)
        stored = table.lookup(request)
        assert stored is not None
        assert stored == server.Generate(request, LocalContext())


def test_the_model_digest_changes_with_the_models_seed_and_a_directorys_config_or_weights(tmp_path: Path) -> None:
    from services.cache.pregenerated import model_digest

    def hf() -> bytes:
        return model_digest(InferenceConfig.parse({"model_id": "m", "backend": {"class": "hf",
                                                                                     "options": {"path": str(tmp_path)}}}))

    assert model_digest(InferenceConfig.parse({"seed": 1})) != model_digest(InferenceConfig.parse({"seed": 2}))
    (tmp_path / "config.json").write_text('{"hidden_size": 8}')
    (tmp_path / "model.safetensors").write_bytes(b"x" * 10)
    first = hf()
    assert hf() == first  # the same directory, the same digest
    (tmp_path / "model.safetensors").write_bytes(b"x" * 11)
    second = hf()
    (tmp_path / "config.json").write_text('{"hidden_size": 16}')
    assert len({first, second, hf()}) == 3
