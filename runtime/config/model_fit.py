"""Defaults that fit a served transformers model on the CPU: `spine up --model DIR` with no config.

On the CPU `device.memory_budget_mib: auto` is 256 MiB and the KV pool may plan with at
most `inference.kv_cpu_memory_cap_mb` (1024 MiB): room for the built-in tiny LMs, not for a
real model (SmolLM2-135M's weights alone are 257 MiB in bfloat16). When the budget is left
at `auto` and the default model is an `hf` directory, `fit_to_model` sizes both from the
model and the machine instead, before anything starts:

    per_slot  = KV bytes per token (config.json) × the served context
    slots     = min(slots asked for, floor((host share × kv_memory_fraction − weights) / per_slot))
    kv cap    = (weights + slots × per_slot) / kv_memory_fraction      (what the pool plans with)
    budget    = kv cap + 256 MiB (the middlewares' tables, as `auto` gives them on the CPU)

where the host share is half the memory the machine has available now, and "slots asked
for" is `kv_cache_max_entries` (or `max_batch` when it is `auto`). The numbers are written
into the config, so every process of a layout (which reads the run's merged config) plans
the same pool, and one line says what was chosen. The deep health probe's bound is raised
to at least `HEALTH_TIMEOUT_S` as well (see there). A budget given as a number is kept as it
is, and so is anything on CUDA (where `auto` already reads the device's free memory). A
model too large for the host share is refused the same way as one that does not fit a
given budget: one line naming `device.memory_budget_mib`, exit 2.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from runtime.config.model import SpineConfig
from services.common import ConfigError
from services.inference.config import HF_CLASS

MIB = 1 << 20
MIDDLEWARE_BYTES = 256 * MIB  # the CPU's `auto` budget: the middlewares' tables, with room to spare
HOST_SHARE = 0.5              # of the memory available at start: others on the machine keep the rest
# The deep health probe's bound (default 2 s) for a real model: its one-token forward of a
# 30-layer model runs beside a full batch's step on the same cores, and past the bound the model
# is NOT_SERVING and its requests UNAVAILABLE (fail-closed). A precaution: on a heavily
# overloaded host the default bound once turned a whole bench cell UNAVAILABLE.
HEALTH_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class ModelFit:
    """What `fit_to_model` chose, and every figure it came from."""

    weight_bytes: int
    per_slot_bytes: int
    context: int
    slots: int
    kv_cap_bytes: int
    budget_bytes: int
    host_bytes: int

    def describe(self, model: str) -> str:
        return (f"model fit: {model}: {_mib(self.weight_bytes)} of weights, KV {_mib(self.per_slot_bytes)} a slot "
                f"(context {self.context}) → device.memory_budget_mib {self.budget_bytes // MIB}, "
                f"inference.kv_cpu_memory_cap_mb {self.kv_cap_bytes // MIB} for {self.slots} slots "
                f"({_mib(self.host_bytes)} available on the host, {HOST_SHARE:.0%} of it at most)")


def plan_fit(*, weight_bytes: int, per_slot_bytes: int, context: int, slots_wanted: int,
             memory_fraction: float, host_bytes: int) -> ModelFit:
    """The budget and KV cap that give `slots_wanted` slots (fewer where the host share is short)."""
    limit = int(host_bytes * HOST_SHARE)
    room = math.floor((limit * memory_fraction - weight_bytes) / per_slot_bytes) if per_slot_bytes else slots_wanted
    slots = max(0, min(slots_wanted, room))
    # One MiB over the exact need: the pool's own arithmetic must find `slots` whole slots in it.
    cap = _round_up_mib(math.ceil((weight_bytes + max(1, slots) * per_slot_bytes) / memory_fraction) + MIB)
    return ModelFit(weight_bytes=weight_bytes, per_slot_bytes=per_slot_bytes, context=context, slots=slots,
                    kv_cap_bytes=cap, budget_bytes=cap + MIDDLEWARE_BYTES, host_bytes=host_bytes)


def fit_to_model(config: SpineConfig, host_bytes: int | None = None) -> tuple[SpineConfig, str | None]:
    """`config` with `device.memory_budget_mib` and `inference.kv_cpu_memory_cap_mb` sized for
    the default model when it is an `hf` directory served on the CPU with an `auto` budget,
    and the line saying what was chosen (None, and `config` itself, when nothing was changed).
    ConfigError when the directory cannot be served (as `preflight` would say), or fits no KV
    slot in the host share. `host_bytes`: the memory available (default: the machine's now)."""
    backend = config.inference.backend
    if backend.class_ != HF_CLASS or config.device.memory_budget_mib != "auto":
        return config, None
    from monolith.device import pick_device

    if pick_device().type != "cpu":
        return config, None
    import psutil

    from services.inference.model.hf_check import check_context, inspect_model_dir, kv_bytes_per_token

    options = backend.options
    where = "inference.backend.options"
    if not options.get("path"):
        return config, None  # preflight names the missing path
    dtype = options.get("dtype")
    info = inspect_model_dir(options["path"], f"{where}.path", dtype if isinstance(dtype, str) else None)
    context = check_context(info, options.get("max_context", backend.max_context), f"{where}.max_context")
    settings = config.inference
    per_token = kv_bytes_per_token(info) or 0
    wanted = settings.max_batch if settings.kv_cache_max_entries == "auto" else int(settings.kv_cache_max_entries)
    fit = plan_fit(weight_bytes=info.weight_bytes, per_slot_bytes=per_token * context, context=context,
                   slots_wanted=wanted, memory_fraction=settings.kv_memory_fraction,
                   host_bytes=int(psutil.virtual_memory().available) if host_bytes is None else host_bytes)
    name = settings.model_id
    if fit.slots < 1:
        raise ConfigError(
            f"device.memory_budget_mib: auto: {name} does not fit this machine: {_mib(fit.weight_bytes)} of weights "
            f"and one KV slot of {_mib(fit.per_slot_bytes)} (context {context}) need {_mib(fit.kv_cap_bytes)} at "
            f"kv_memory_fraction {settings.kv_memory_fraction}, {HOST_SHARE:.0%} of the available "
            f"{_mib(fit.host_bytes)} is less; give device.memory_budget_mib, a shorter max_context or a smaller model")
    cap_mb = max(float(settings.kv_cpu_memory_cap_mb), float(fit.kv_cap_bytes // MIB))
    health_s = max(float(settings.health_timeout_s), HEALTH_TIMEOUT_S)
    fitted = config.with_overrides({"device": {"memory_budget_mib": fit.budget_bytes // MIB},
                                    "inference": {"kv_cpu_memory_cap_mb": cap_mb, "health_timeout_s": health_s}})
    return fitted, f"{fit.describe(name)}; inference.health_timeout_s {health_s:g}"


def _round_up_mib(nbytes: int) -> int:
    return -(-nbytes // MIB) * MIB


def _mib(nbytes: int) -> str:
    return f"{nbytes / MIB:.1f} MiB"
