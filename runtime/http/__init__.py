"""The public HTTP/JSON API: OpenAI- and Anthropic-compatible endpoints on the one pipeline.

What a migration keeps unchanged is the API its clients already call. This package serves
it over HTTP/1.1 in front of any object with the Gateway servicer's call shape — the
gateway itself (the spine and the layered gateway serve it in their own process) or the
migration's front (which splits it like gRPC traffic) — so every HTTP request is decided by
the same admission and completion steps as a gRPC one, with the same verdicts.

- `config`: the `http:` section;
- `wire`: status codes, headers and the load hint, shared by both APIs;
- `openai_api`, `anthropic_api`: each API's requests, answers, streams and errors;
- `app`: the ASGI application (routing, body limits, the call on a handler thread, SSE);
- `server`: uvicorn in a thread of the serving process, with read timeouts and a connection cap.
"""
