"""A migration's "from" side when it is not spine's layered stack: any HTTP endpoint speaking
the OpenAI/Anthropic API (LiteLLM's proxy, Kong, an nginx/Envoy chain, a hosted API).

A plan names it (`legacy: {http: URL, api_key_header: HEADER}`) and the data path is built
for it (`migration.traffic.http_front`); the controller refuses a plan whose `legacy:` is not
the endpoint its data path splits traffic with, so a persisted plan can never walk traffic
away from an endpoint other than the one it was written for.
"""

from __future__ import annotations

import re
import urllib.parse
from dataclasses import dataclass

DEFAULT_API_KEY_HEADER = "authorization"
# An HTTP field name (RFC 9110's token), lower case as it is matched.
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9a-z-]+")


@dataclass(frozen=True)
class LegacyEndpoint:
    """`http`: where the API's paths begin (the front appends the client's, e.g.
    `/v1/chat/completions`). `api_key_header`: the header that carries a client's key there
    (`authorization` for `Bearer KEY`, `x-api-key`, or a gateway's own such as Kong's `apikey`);
    the front forwards the key unchanged, and to the spine as `authorization: Bearer KEY`."""

    http: str
    api_key_header: str = DEFAULT_API_KEY_HEADER

    def describe(self) -> str:
        return f"{self.http} (key in {self.api_key_header})"


def legacy_problems(url: object, header: object) -> list[tuple[str, str]]:
    """(field, problem) for each thing wrong with a `legacy:` section's values."""
    problems: list[tuple[str, str]] = []
    if not isinstance(url, str) or not url.strip():
        problems.append(("http", f"must be the endpoint's URL, e.g. http://127.0.0.1:4000, got {url!r}"))
    else:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            problems.append(("http", f"expected http://HOST:PORT or https://HOST:PORT, got {url!r}"))
        elif parts.query or parts.fragment:
            problems.append(("http", f"a base URL has no query or fragment, got {url!r}"))
        elif parts.path.rstrip("/").endswith("/v1"):
            problems.append(("http", f"give the root the API's paths begin under, without /v1: the front "
                                     f"appends the client's path (/v1/chat/completions); got {url!r}"))
    if not isinstance(header, str) or not _HEADER_NAME.fullmatch(header):
        problems.append(("api_key_header", f"must be a lower-case header name such as authorization, x-api-key "
                                           f"or apikey, got {header!r}"))
    elif header.startswith("x-spine-"):
        problems.append(("api_key_header", f"x-spine-* headers are the deployment's own, got {header!r}"))
    return problems


def endpoint(url: str, api_key_header: str = DEFAULT_API_KEY_HEADER) -> LegacyEndpoint:
    """A checked LegacyEndpoint (ValueError naming every problem), its URL without a trailing slash."""
    problems = legacy_problems(url, api_key_header)
    if problems:
        raise ValueError("; ".join(f"legacy {field}: {problem}" for field, problem in problems))
    return LegacyEndpoint(url.rstrip("/"), api_key_header)
