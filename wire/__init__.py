"""The generated wire types (`wire/v1`, written by `make protos` from `protos/wire/v1/*.proto`).

This file is committed so the editable install maps `wire` when it runs, before the stubs
exist: `import wire.v1` then works from any directory, not only the repository root.
"""
