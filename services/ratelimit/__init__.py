"""Rate limiting: token buckets per (tenant, model, resource) and concurrency slots per tenant.

Modules: `service` (the `spine.v1.RateLimit` servicer), `config` (its config section),
`steps` (admission before the model, the concurrency slot's release after), `admission`
(decisions on plain values and the batch rpc's codec), `descriptors` (an ask's descriptors
checked and resolved to their buckets), `token_buckets` (the buckets as one device tensor),
`batch_decisions` (a batch decided on them at once, exactly as one by one), `concurrency`
(slots), `leases`, `lease_accounting` and `lease_store` (limits across replicas: tokens
leased from a shared Redis store),
`envoy_ratelimit` (Envoy's rate limit service API, both ways).

Why buckets live on the device: the spine decides a whole micro-batch in one tensor operation
next to the model; the layered process runs the same code on its own host tensors.
"""
