"""A dataclass crosses the wire by field name: every field survives the round trip, and a
dataclass the message cannot hold is refused when its codec is made, not dropped later."""

from __future__ import annotations

from dataclasses import dataclass, fields

import pytest

from services.common.proto_fields import FieldCodec
from services.ratelimit.admission import AdmitItem
from services.ratelimit.api import ReleaseItem
from wire.v1 import ratelimit_pb2


def test_every_release_field_survives_the_round_trip() -> None:
    codec = FieldCodec(ReleaseItem, ratelimit_pb2.ReleaseRequest)
    item = ReleaseItem(lease_id=3, tenant="acme", model="m", tokens_charged=40, tokens_used=31, key="k1",
                       team="blue", prompt_tokens=20, cached_prompt_tokens=8, completion_tokens=11,
                       key_tokens_per_minute=1500.5)
    message = codec.to_message(item)
    assert {f.name for f in fields(ReleaseItem)} <= {f.name for f, _ in message.ListFields()}
    assert codec.from_message(ratelimit_pb2.ReleaseRequest.FromString(message.SerializeToString())) == item


def test_every_admit_field_survives_the_round_trip() -> None:
    codec = FieldCodec(AdmitItem, ratelimit_pb2.AdmitRequest)
    item = AdmitItem("acme", "m", 12, dry_run=True, lease_ttl_s=2.5, busy=0.25, key="k", team="t",
                     key_requests_per_minute=60, key_tokens_per_minute=600, key_budget_usd=1.5,
                     key_budget_window="day")
    assert codec.from_message(codec.to_message(item)) == item


def test_a_field_the_message_lacks_is_refused_by_name() -> None:
    @dataclass
    class Stray:
        tenant: str
        colour: str

    with pytest.raises(TypeError, match="no field colour"):
        FieldCodec(Stray, ratelimit_pb2.AdmitRequest)


def test_a_repeated_field_is_refused_rather_than_read_as_a_container() -> None:
    @dataclass
    class Batch:
        items: list[AdmitItem]

    with pytest.raises(TypeError, match="Batch.items"):
        FieldCodec(Batch, ratelimit_pb2.AdmitBatchRequest)
