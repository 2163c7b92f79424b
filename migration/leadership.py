"""Leader election over the shared store: one controller replica leads under a lease.

Like client-go's leaderelection (what Argo Rollouts' and Flagger's `--leader-elect` use),
with Kubernetes' defaults: a lease lasts `duration_s` (15 s) from its last renewal; the
leader renews every `retry_period_s` (2 s) and stops leading when it could not renew for
`renew_deadline_s` (10 s), which is shorter than the lease so that it has stopped before
anyone else may take over; a replica that does not lead tries every `retry_period_s` and
takes the lease once it expired, with one more epoch.

Stopping on time is a courtesy, not the guarantee: a leader paused (SIGSTOP, a GC pause,
a partition) for longer than the lease wakes up believing it leads. The guarantee is the
store's fence (`Store.fence_with`): every write checks, in its own transaction, that the
writer's epoch is still the current, live one, and the controller checks the same before
it pushes anything to the data path. So `leading` here is what makes a replica TRY to
tick; the fence is what makes a stale one fail.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from migration.lease import LeaseRecord
from migration.state_store import Store
from services.common import ConfigError
from services.common.log_limit import RateLimitedLog

log = logging.getLogger("spine.migration")
_store_down = RateLimitedLog(log, "election rounds without the store")


@dataclass(frozen=True)
class LeaseSettings:
    duration_s: float = 15.0
    renew_deadline_s: float = 10.0
    retry_period_s: float = 2.0

    def __post_init__(self) -> None:
        if not 0 < self.retry_period_s < self.renew_deadline_s < self.duration_s:
            raise ConfigError(
                f"lease: need 0 < --lease-retry-period-s ({self.retry_period_s:g}) < --lease-renew-deadline-s "
                f"({self.renew_deadline_s:g}) < --lease-duration-s ({self.duration_s:g}): the leader must give up "
                "before its lease expires, and try more than once before it gives up")


def default_identity() -> str:
    """host:pid (a pod's name is its host name): unique among live replicas."""
    return f"{socket.gethostname()}:{os.getpid()}"


class NotLeader(RuntimeError):
    """A write sent to a replica that does not lead; names the leader to send it to."""


class LeaderElector:
    """Runs the election in a thread of its own; calls `on_lead(epoch)` when this replica
    starts leading and `on_lose()` when it stops (both from that thread)."""

    def __init__(self, store: Store, identity: str, address: str, settings: LeaseSettings, *,
                 on_lead: Callable[[int], None] | None = None, on_lose: Callable[[], None] | None = None) -> None:
        self._store = store
        self.identity = identity
        self.address = address
        self.settings = settings
        self._on_lead = on_lead
        self._on_lose = on_lose
        self._epoch: int | None = None
        self._renewed_mono = 0.0
        self._observed: LeaseRecord | None = None
        self._stop = threading.Event()
        self._lock = threading.RLock()  # the election round and a step-down never interleave
        self._thread = threading.Thread(target=self._run, name="leader-election", daemon=True)
        store.elected()

    def start(self) -> LeaderElector:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop electing; a leader releases its lease so another replica takes over at once."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        with self._lock:
            epoch = self._epoch
            if epoch is not None:
                self._lose()
        if epoch is not None:
            try:
                self._store.release(self.identity, epoch)
            except Exception:  # the store is gone: the lease expires on its own
                log.warning("could not release the leader lease (epoch %d); it expires on its own", epoch)

    @property
    def leading(self) -> bool:
        """Leading, and renewed within the renew deadline by this process's own clock (a
        replica that was paused past it stops ticking before it even asks the store)."""
        return (self._epoch is not None
                and time.monotonic() - self._renewed_mono < self.settings.renew_deadline_s)

    @property
    def epoch(self) -> int | None:
        return self._epoch

    def leader(self) -> LeaseRecord | None:
        """The lease as last observed (None before the first look, or while none is live)."""
        observed = self._observed
        return observed if observed is not None and observed.live else None

    def check_write(self) -> None:
        """Raise NotLeader (naming the leader) unless this replica leads now."""
        if not self.leading:
            self.refuse_write()

    def refuse_write(self) -> None:
        """Raise NotLeader naming whoever leads (or saying that an election or a takeover is
        under way)."""
        try:  # the lease as it stands (what this replica last saw may be older: it was paused)
            current = self._store.lease()
            leader = current if current is not None and current.live else None
        except Exception:
            leader = self.leader()
        if leader is not None and leader.holder == self.identity and self.leading:
            raise NotLeader(f"controller {self.identity} is taking over (lease epoch {leader.epoch}); retry in a moment")
        if leader is None or leader.holder == self.identity:
            raise NotLeader(f"controller {self.identity} does not lead and no leader holds a live lease right now "
                            "(an election is under way); retry in a few seconds")
        raise NotLeader(f"controller {self.identity} does not lead: send writes to the leader, {leader.describe()}")

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                self._round()
            self._stop.wait(self.settings.retry_period_s)

    def _round(self) -> None:
        started = time.monotonic()
        try:
            lease = self._store.try_acquire(self.identity, self.address, self.settings.duration_s, self._epoch)
        except Exception as error:  # the store is unreachable: lead on until the renew deadline
            _store_down("election", "leader election: the store did not answer (%s)", error)
            if self._epoch is not None and not self.leading:
                log.warning("could not renew the lease (epoch %d) within %gs: no longer leading", self._epoch,
                            self.settings.renew_deadline_s)
                self._lose()
            return
        self._observed = lease
        # Ours only if this round renewed our epoch or took a new one (not merely our name on
        # a live lease from before we gave up: that epoch is fenced off, it has to expire).
        if lease.ours:
            if self._epoch != lease.epoch:
                if self._epoch is not None:
                    self._lose()
                self._epoch = lease.epoch
                self._renewed_mono = started
                log.info("leading with lease epoch %d (%s)", lease.epoch, self.identity)
                if self._on_lead is not None:
                    self._on_lead(lease.epoch)
            else:
                self._renewed_mono = started
        elif self._epoch is not None:
            log.warning("lost the lease (epoch %d): %s leads now", self._epoch, lease.describe())
            self._lose()

    def step_down(self) -> None:
        """Stop leading now (a write was fenced: the lease is someone else's, or expired)."""
        with self._lock:
            if self._epoch is not None:
                log.warning("a write was fenced: no longer leading (epoch %d)", self._epoch)
                self._lose()

    def _lose(self) -> None:
        self._epoch = None
        self._store.fence_with(self.identity, None)
        if self._on_lose is not None:
            self._on_lose()
