"""How many tokens a text is, when the model that wrote it did not say.

An upstream that answers without `usage` (some engines, some proxies, a stream without
`stream_options.include_usage` honoured) still used tokens, and the tenant's token buckets
and budgets must be charged for them. The spine does not have the tokenizer of a model that
runs elsewhere (unless its config names the model's tokenizer: `TOKENIZER`,
`services.inference.upstream.token_count`), so it estimates: the text's UTF-8 bytes divided by 4, rounded up (OpenAI's
own rule of thumb for English, about 4 characters a token; it over-counts text in scripts
whose characters are several bytes, which errs on charging rather than giving away). The
answer's usage says which count it carries (`USAGE_HEADER`): `upstream` (the model's own),
`tokenizer` (the model's tokenizer, run here) or `estimate` (this one), the same for a whole
answer and a stream.
"""

from __future__ import annotations

BYTES_PER_TOKEN = 4
UPSTREAM = "upstream"  # the upstream's own usage
TOKENIZER = "tokenizer"  # the model's own tokenizer, run by the spine (an upstream's tokenizer_file)
ESTIMATE = "estimate"  # estimate_tokens: UTF-8 bytes / 4, rounded up


def estimate_tokens(text: str) -> int:
    """The estimated tokens of `text` (0 for no text)."""
    return -(-len(text.encode("utf-8", "replace")) // BYTES_PER_TOKEN)
