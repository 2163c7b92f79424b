"""Who leads, as `spine migrate status` prints it and as its JSON (the dashboard's) carries it."""

from __future__ import annotations

from rich.console import Console

from migration.render import status_renderable, to_json
from wire.v1 import migration_pb2 as pb


def printed(status: pb.RolloutStatus) -> str:
    console = Console(width=200, record=True)
    console.print(status_renderable(status))
    return console.export_text()


def test_a_follower_names_the_leader_its_address_and_epoch():
    status = pb.RolloutStatus(state="progressing", leadership=pb.Leadership(
        leader="r2", leader_address="unix:/run/r2.sock", epoch=3, controller="r1", leading=False, fenced_writes=2))
    text = printed(status)
    assert "r2 at unix:/run/r2.sock, epoch 3 (asked r1, which follows)" in text
    assert "2 write(s) refused by the fence here" in text
    assert to_json(status)["leadership"] == {"leader": "r2", "leader_address": "unix:/run/r2.sock", "epoch": "3",
                                             "controller": "r1", "leading": False, "fenced_writes": "2"}


def test_the_leader_says_it_is_the_one():
    status = pb.RolloutStatus(state="progressing", leadership=pb.Leadership(
        leader="r2", leader_address="unix:/run/r2.sock", epoch=3, controller="r2", leading=True))
    assert "epoch 3 (this replica)" in printed(status)


def test_no_leader_during_an_election_and_no_line_for_a_single_controller():
    electing = pb.RolloutStatus(state="progressing", leadership=pb.Leadership(controller="r1"))
    assert "none right now (an election is under way)" in printed(electing)
    assert "leader" not in printed(pb.RolloutStatus(state="progressing"))
    assert "leadership" not in to_json(pb.RolloutStatus(state="progressing"))
