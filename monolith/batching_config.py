"""The `batching` section: whether and how the spine batches the pipeline (`monolith.batched`).

Apart from `monolith.batched` because it is a pydantic model, and that module is compiled
(`services.compiled`): pydantic cannot read the methods of a class Cython compiled.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import Field, StrictBool, StrictInt

from services.config_model import Float, Section


class BatchingConfig(Section):
    """The `batching` section: whether and how the pipeline batches."""

    enabled: StrictBool = True
    # Also batch calls to components in other processes (one batch rpc per hop per batch).
    # Off by default: the layered layout then makes one call per request per hop, as a
    # layered stack does; `make bench` measures it on (`layered-batched`).
    remote: StrictBool = False
    max_batch: Annotated[StrictInt, Field(ge=1, le=4096)] = 32
    # How long a batch's leader may wait for more requests, and only while that wait is free:
    # more requests are in flight than queued, none of them is of the latency class, and the
    # models they name already have a full batch queued (so admitted a few ms later they
    # lose no model time). Without a backlog the leader decides at once: a lone request, or
    # 16 clients on 16 KV slots, never waits. With one (64 clients on one core), admission
    # on the core the model's steps share went in batches of one, each stage starting on
    # caches the step had just used; with the wait (batches of 3-5), the handlers' CPU per
    # request fell in all six focused A/Bs at c=64 (`python -m bench.variants --vary
    # batching.max_wait_us=0,10000`): 592 -> 445, 622 -> 480, 697 -> 616, 588 -> 500,
    # 901 -> 679, 705 -> 613 µs (bare ~300); throughput mostly rose (0.91 -> 1.02, 0.76 ->
    # 0.94) but within this host's noise. 30 and 60 ms waits gave no larger batches' worth.
    # Waits without the backlog rule (300 µs to 3 ms, every batch) never paid: a sleeping
    # leader is one more hand-off per batch. Nor did a yield instead of a wait (tried at
    # c=16, where nothing queues on one CPU: a leader about to decide alone while others
    # were in flight queued itself and called os.sched_yield, so handlers already runnable
    # joined its batch): batches of 2-6 formed and the handlers' CPU per request fell by
    # 10-154 µs in four A/Bs (c=64: -53 to +113), but the decode loop's mostly rose by as
    # much (it stepped with fewer requests admitted); throughput did not move past the noise.
    max_wait_us: Annotated[Float, Field(ge=0, le=100_000)] = 10_000.0
    # How often finished requests' completions are written, a window at a time, off the
    # request path; readers and shutdown never wait for it. 250 ms instead of 50 cut the
    # writer's CPU per request (c=16: 130 -> 53 µs, c=64: 81 -> 62) in one A/B, lost in the
    # handlers' noise there (throughput 0.861 -> 0.850 and 0.865 -> 0.882 of bare): not changed.
    completion_interval_ms: Annotated[Float, Field(ge=1, le=10_000)] = 50.0

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> BatchingConfig:
        """The `batching` section of a whole config mapping."""
        return cls.parse(config.get("batching"), "batching")

    def batches(self, placement: str) -> bool:
        """Whether a stage whose component has `placement` is batched."""
        return self.enabled and (placement == "local" or self.remote)
