"""The headers every answer goes out with, in every layout.

An answer's trailers (an HTTP client's headers) say who answered and how loaded it is, so a
client can act on them: the layout and request id, what came from downstream (an upstream's
own), the routed model's load hint (the latest one the gateway has when the model did not
send one: `x-spine-load`), a fallback's name (`x-spine-fallback`) or, on a fallback's answer,
the load of the models it stands in for (`x-spine-primary-load`, when to go back), the
tenant's budget left, and the time the spine itself added (`x-spine-overhead-duration-ms`).
"""

from __future__ import annotations

import time

from services.gateway.model_load import ModelLoads
from services.inference.load_hints import FALLBACK_HEADER, LOAD_HEADER, PRIMARY_LOAD_HEADER
from services.pipeline.state import RequestState
from services.pipeline.verdicts import BUDGET_HEADER, OVERHEAD_HEADER

Headers = tuple[tuple[str, str], ...]


def answer_trailing(state: RequestState, base: Headers, loads: ModelLoads, downstream: Headers = ()) -> Headers:
    """`base` (layout and request id), `downstream`'s, and what the gateway adds for `state`."""
    if state.resolved is not None:
        loads.learn(state.request.model, state.model)
    out = [*base, *downstream]
    if all(key != LOAD_HEADER for key, _ in downstream):
        hint = loads.hint(state.model)
        if hint:
            out.append((LOAD_HEADER, hint))
    if state.fallback:
        out.append((FALLBACK_HEADER, state.fallback))
    primaries = [f"{primary}:{hint}" for primary in state.fallback_of if (hint := loads.hint(primary))]
    if primaries:
        out.append((PRIMARY_LOAD_HEADER, ",".join(primaries)))
    if state.budget_remaining_usd >= 0 and all(key != BUDGET_HEADER for key, _ in downstream):
        out.append((BUDGET_HEADER, f"{state.budget_remaining_usd:.6f}"))
    overhead_s = time.perf_counter() - state.arrived - state.model_wait_s
    out.append((OVERHEAD_HEADER, f"{max(0.0, overhead_s) * 1000.0:.3f}"))
    return tuple(out)
