"""The leader lease as the store records it, and the refusal a fenced write gets.

One row: who holds the lease (`holder`, with the `address` its operator API answers on),
its `epoch` (one more at every change of hands: the fencing token), when it was last
renewed and for how long a renewal holds, all timed by the database's clock so that no
replica's clock matters. See `migration.leadership` for the election and docs/migration.md
for how this maps onto a Kubernetes `coordination.k8s.io` Lease.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class LeaseRecord:
    holder: str
    address: str
    epoch: int
    acquired_at: float
    renewed_at: float
    duration_s: float
    now: float  # the database's clock when this was read
    ours: bool = False  # the round that read it renewed or took it for the one asking

    @property
    def live(self) -> bool:
        return self.now < self.renewed_at + self.duration_s

    def claimed(self) -> LeaseRecord:
        return replace(self, ours=True)

    def describe(self) -> str:
        where = f" at {self.address}" if self.address else ""
        return f"{self.holder}{where} (epoch {self.epoch})"


class Fenced(RuntimeError):
    """A write refused because the writer does not hold the current lease epoch: nothing
    was committed, and nothing should be pushed on its behalf."""

    def __init__(self, message: str, leader: LeaseRecord | None) -> None:
        super().__init__(message)
        self.leader = leader


@dataclass(frozen=True)
class LeadershipView:
    """Who leads, as the replica asked sees it (the status's `leadership`)."""

    leader: str
    leader_address: str
    epoch: int
    controller: str
    leading: bool
    fenced_writes: int
