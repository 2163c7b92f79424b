"""What a stream adds up to as its chunks pass the gateway.

The gateway's stream is the same on a handler thread (`Gateway.GenerateStream`) and on the
HTTP front's event loop (`Gateway.generate_stream_on_loop`): each chunk is policed and counted
the same way, so the record, the charge and the cached answer do not depend on which ran it.
`StreamTally` is that count.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from services.common.token_estimate import estimate_tokens
from services.gateway.usage import used
from services.pipeline.state import RequestState
from wire.v1 import generation_pb2


@dataclass
class StreamTally:
    """A stream's chunks so far: its tokens and text, its finish, its system digest and the
    usage the model counted itself (an upstream's, on its last chunk)."""

    started: float  # when the model was called (perf_counter)
    check: Any  # the output policy's check for this stream (None: no policy)
    tokens: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    finish: str = ""
    digest: str = ""
    usage: tuple[int, int, int] = (0, 0, 0)  # prompt, completion, cached
    first: bool = True  # no chunk has been released yet

    def take(self, chunk: generation_pb2.GenerateChunk) -> bool:
        """Count `chunk`; whether it is the stream's first."""
        first, self.first = self.first, False
        self.tokens.extend(chunk.token_ids)
        self.texts.append(chunk.text)
        self.finish = chunk.finish_reason or self.finish
        self.digest = chunk.system_digest or self.digest
        if chunk.completion_tokens or chunk.prompt_tokens:
            self.usage = (chunk.prompt_tokens, chunk.completion_tokens, chunk.cached_prompt_tokens)
        return first

    def settle(self, state: RequestState, component: str) -> None:
        """What was generated, however the stream ended (an aborted one is charged up to
        where it stopped): the model's count, else its tokens, else its text's estimate (an
        upstream's chunks carry no token ids; the same estimate an upstream's answer without
        usage is charged). The stream's time is `component`'s."""
        state.add_time(component, time.perf_counter() - self.started)
        prompt, completion, cached = self.usage
        used(state, prompt, completion or len(self.tokens) or estimate_tokens("".join(self.texts)), cached)

    def end(self, state: RequestState, trailing: Sequence[tuple[str, str]]) -> Sequence[tuple[str, str]]:
        """The stream ended well: its whole answer on `state` (for the completions: cache,
        logs), its time the model's; the model's `trailing` handed back."""
        assert state.resolved is not None
        state.model_wait_s = time.perf_counter() - self.started
        state.response = generation_pb2.GenerateResponse(
            text="".join(self.texts), token_ids=self.tokens, model=state.resolved.model, finish_reason=self.finish,
            prompt_tokens=state.prompt_tokens, completion_tokens=state.completion_tokens, system_digest=self.digest,
            cached_prompt_tokens=state.cached_tokens)
        return trailing


def hit_chunk(hit: generation_pb2.GenerateResponse) -> generation_pb2.GenerateChunk:
    """The cache's answer as a stream's one chunk (an upstream's answer has no token ids, only
    its counts: those go on the chunk as a model's last chunk carries them)."""
    counted = not hit.token_ids
    return generation_pb2.GenerateChunk(text=hit.text, token_ids=hit.token_ids, index=0,
                                        finish_reason=hit.finish_reason, cached=True, model=hit.model,
                                        system_digest=hit.system_digest,
                                        prompt_tokens=hit.prompt_tokens if counted else 0,
                                        completion_tokens=hit.completion_tokens if counted else 0)

