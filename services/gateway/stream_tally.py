"""What a stream adds up to as its chunks pass the gateway.

The gateway's stream is the same on a handler thread (`Gateway.GenerateStream`) and on the
HTTP front's event loop (`Gateway.generate_stream_on_loop`): each chunk is policed and counted
the same way, so the record, the charge and the cached answer do not depend on which ran it.
`StreamTally` is that count.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

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

    def response(self, state: RequestState, model: str) -> generation_pb2.GenerateResponse:
        """The stream's whole answer (for the completions: cache, logs), with what it used."""
        return generation_pb2.GenerateResponse(
            text="".join(self.texts), token_ids=self.tokens, model=model, finish_reason=self.finish,
            prompt_tokens=state.prompt_tokens, completion_tokens=state.completion_tokens, system_digest=self.digest,
            cached_prompt_tokens=state.cached_tokens)


def hit_chunk(hit: generation_pb2.GenerateResponse) -> generation_pb2.GenerateChunk:
    """The cache's answer as a stream's one chunk (an upstream's answer has no token ids, only
    its counts: those go on the chunk as a model's last chunk carries them)."""
    counted = not hit.token_ids
    return generation_pb2.GenerateChunk(text=hit.text, token_ids=hit.token_ids, index=0,
                                        finish_reason=hit.finish_reason, cached=True, model=hit.model,
                                        system_digest=hit.system_digest,
                                        prompt_tokens=hit.prompt_tokens if counted else 0,
                                        completion_tokens=hit.completion_tokens if counted else 0)

