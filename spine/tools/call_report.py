"""What `spine call` prints for one call: the answer, its status, trailers and the helper's state."""

from __future__ import annotations

import json
from typing import Any

from spine.client.gateway_client import CallResult
from spine.client.overload_client import LoadAwareClient


def print_call(result: CallResult, helper: LoadAwareClient, *, as_json: bool, call: int | None = None,
               hint: str | None = None) -> None:
    """One call's answer: JSON (one object a line) or text; with --fallback, the helper's state;
    `hint` says what to try when a TLS handshake or credential was refused."""
    out: dict[str, Any] = {
        "status": result.code.name, "details": result.details, "latency_ms": round(result.latency_s * 1000, 3),
        "text": result.text, "token_ids": result.token_ids, "trailing": result.trailing,
        "attempts": result.attempts, "model": result.model, "load": result.load,
    }
    if result.first_chunk_s is not None:
        out["first_chunk_ms"] = round(result.first_chunk_s * 1000, 3)
    if helper.fallback is not None:
        out["fallback"] = {"active": helper.using_fallback, "model": helper.fallback_model, "why": helper.why}
    if hint:
        out["hint"] = hint
    if as_json:
        print(json.dumps(out if call is None else {"call": call + 1, **out}))
        return
    if call is not None:
        print(f"--- call {call + 1}")
    print(f"status:  {out['status']}" + (f" ({result.details})" if result.details else ""))
    if hint:
        print(f"hint:    {hint}")
    print(f"latency: {out['latency_ms']} ms   layout: {result.layout}   model: {result.model}   "
          f"request id: {result.trailing.get('x-request-id', '')}   attempts: {result.attempts}")
    if result.load:
        print(f"load:    {result.trailing.get('x-spine-load', '')}")
    if helper.fallback is not None:
        state = f"on {helper.fallback_model!r} ({helper.why})" if helper.using_fallback else \
            f"off (fallback: {helper.fallback_model or 'none known yet'})"
        print(f"fallback: {state}")
    if result.ok:
        print(f"answer:  {result.text!r}")
