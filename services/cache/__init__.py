"""The response cache: answers for deterministic requests, per tenant, for a while; and a table
of pre-generated answers mapped read-only from one file.

Modules: `service` (the `spine.v1.Cache` servicer), `config` (its config section), `steps`
(the lookup before the model, the store after it), `index` (the open-addressing index whose
columns live on the device), `pregenerated` (the file format `spine cache build` writes) and
`pregenerated_answers` (the table a process serves from, and how it is swapped).
"""
