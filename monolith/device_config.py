"""The `device:` config section: how much memory the shared device context may account.

Kept apart from `monolith.device` (which imports torch) so that loading, checking or
printing the config does not load torch.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from services.common.config_section import AutoOrCount, Float, Section


class DeviceConfig(Section):
    """`device`: the budget every allocation through a `DeviceContext` counts against.

    Middleware tables, the KV cache pool (`inference.kv_cache_max_entries: auto` plans within
    what is left of it) and everything else a service allocates on the device share it, so
    one owner cannot starve the others. `auto` sizes it when the process starts."""

    where = "device"

    memory_budget_mib: AutoOrCount = Field(
        default="auto", description="MiB, or 'auto': on CUDA auto_memory_fraction of the free device memory "
                            "at start; on the CPU 256 MiB, or sized for an hf default model "
                            "(runtime.config.model_fit)")
    auto_memory_fraction: Annotated[Float, Field(gt=0, le=1)] = 0.9
