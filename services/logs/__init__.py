"""Request logs: one structured JSON line per request, written in batches, secrets redacted.

Modules: `service` (the `spine.v1.Logs` servicer), `config` (its config section), `steps`
(the pipeline's completion step that hands every finished request to the log), `ring` (a
preallocated ring of encoded lines and the flusher thread that writes them, so a request
never waits on the disk; flushed on shutdown so nothing accepted is lost).
"""
