"""Models served by an upstream OpenAI- or Anthropic-compatible server (`router.models[].upstream`).

`service.UpstreamModels` answers the inference rpcs for them; `attempts.Walk` retries and
falls back before the first byte; `endpoint.UpstreamEndpoint` is one upstream (its HTTP/2
capable connection pool, outlier ejection, retry budget, concurrency cap); `protocols` the two
wire shapes; `loop` the event loop every upstream call runs on. Imported only where an
upstream model is configured: a process without one never loads the HTTP client.
"""
