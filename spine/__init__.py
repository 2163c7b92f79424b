"""spine: a layered gRPC middleware stack collapsed into the inference process, stage by stage.

Importing the package asks torch (not imported yet) to put its large CPU buffers — model
weights, the KV cache, the device tables — on transparent huge pages (2 MiB, `madvise`).
Why: with 4 KiB pages the model's step time varied widely from one process to the next
on the same code (for the same requests, depending on where its weights landed), which is
slower on average and made every side-by-side ratio a draw; on huge pages one process after
another kept nearly the same step time. It must be set before torch
is imported (torch reads it once, at its first allocation), so it lives here, ahead of
every `python -m spine…` entry point. An operator's own `THP_MEM_ALLOC_ENABLE` wins
(`0` turns it off); the kernel must allow `madvise` huge pages (the default on Linux).
"""

import os

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
