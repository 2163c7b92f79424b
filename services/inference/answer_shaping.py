"""The built-in model's step outputs as the caller's answer: a whole one, or chunk by chunk,
cut at the request's stop strings.

Apart from the service because it is the same whether the outputs were waited for on a
thread or awaited on an event loop (`InferenceService.answer` / `answer_on_loop`, `chunks` /
`chunks_on_loop`): one place decides where an answer ends and what its chunks hold.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.inference.model.backend import ModelBackend
from services.inference.model.engine import StepOutput
from services.inference.stop_strings import first_stop, safe_length
from services.pipeline.system_prompt import system_digest
from wire.v1 import generation_pb2


class WholeAnswer:
    """A unary answer's tokens as they come, then the response they make."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.finish = ""

    def take(self, output: StepOutput) -> None:
        if output.finish_reason != "stop":  # a stop's token is EOS, not part of the answer
            self.tokens.append(output.token_id)
        self.finish = output.finish_reason or self.finish

    def response(self, backend: ModelBackend, request: generation_pb2.GenerateRequest, stops: Sequence[str],
                 prompt_tokens: int) -> generation_pb2.GenerateResponse:
        tokens, finish = self.tokens, self.finish
        text, stop_sequence = backend.decode(tokens), ""
        found = first_stop(text, stops) if stops else None
        if found is not None:  # the answer ends before the stop string; its tokens up to the one completing it
            tokens = tokens[:_tokens_to(backend, tokens, found[0] + len(found[1]))]
            text, stop_sequence, finish = text[:found[0]], found[1], "stop"
        return generation_pb2.GenerateResponse(
            text=text, token_ids=tokens, model=request.model, finish_reason=finish, stop_sequence=stop_sequence,
            prompt_tokens=prompt_tokens, completion_tokens=len(tokens), system_digest=system_digest(request.system))


class StreamedAnswer:
    """A stream's chunks, one per step output: text held back while it could still be the
    start of a stop string, and the stream's end where one is found (`ended`)."""

    def __init__(self, backend: ModelBackend, request: generation_pb2.GenerateRequest, stops: Sequence[str]) -> None:
        self.backend, self.request, self.stops = backend, request, stops
        self.digest = system_digest(request.system)
        self.tokens: list[int] = []
        self.sent = ""
        self.index = 0
        self.ended = False  # the last chunk has been made (the output finished, or a stop string was found)

    def chunk(self, output: StepOutput) -> generation_pb2.GenerateChunk:
        index, self.index = self.index, self.index + 1
        new = [] if output.finish_reason == "stop" else [output.token_id]
        self.tokens.extend(new)
        text = self.backend.decode(self.tokens)
        found = first_stop(text, self.stops) if self.stops else None
        if found is not None:  # the answer ends here: the rest of the job is cancelled by its reader
            self.ended = True
            return generation_pb2.GenerateChunk(text=text[len(self.sent):found[0]], token_ids=new, index=index,
                                                finish_reason="stop", model=self.request.model,
                                                system_digest=self.digest, stop_sequence=found[1])
        shown = len(text) if output.finished or not self.stops else safe_length(text, self.stops)
        piece, self.sent = text[len(self.sent):shown], text[:shown]
        self.ended = output.finished
        return generation_pb2.GenerateChunk(text=piece, token_ids=new, index=index,
                                            finish_reason=output.finish_reason or "", model=self.request.model,
                                            system_digest=self.digest)


def _tokens_to(backend: ModelBackend, tokens: list[int], chars: int) -> int:
    """The fewest tokens whose text is at least `chars` long (binary search: decoding is
    monotone in the prefix)."""
    low, high = 0, len(tokens)
    while low < high:
        middle = (low + high) // 2
        if len(backend.decode(tokens[:middle])) >= chars:
            high = middle
        else:
            low = middle + 1
    return low
