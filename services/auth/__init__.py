"""Auth: a bearer credential (an API key or a JWT) becomes a principal, or a denial.

Modules: `service` (the `spine.v1.Auth` servicer, its config section and the verdict cache),
`steps` (its pipeline step: the first admission step, fail-closed), `api_keys` (keys held as
SHA-256 digests), `jwt_verify` (which key verifies which algorithm), `envoy_authz` (Envoy's
`ext_authz` API served by, and called from, this component).

It decides the same in every layout: the collapsed process calls the servicer in-process, the
layered gateway over gRPC; the verdict cache keys on a digest of the credential, never on it.
"""
