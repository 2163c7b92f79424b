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
from dataclasses import dataclass, field

DEFAULT_API_KEY_HEADER = "authorization"
# An HTTP field name (RFC 9110's token), lower case as it is matched.
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9a-z-]+")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,39}")


@dataclass(frozen=True)
class LegacyEndpoint:
    """`http`: where the API's paths begin (the front appends the client's, e.g.
    `/v1/chat/completions`). `api_key_header`: the header that carries a client's key there
    (`authorization` for `Bearer KEY`, `x-api-key`, or a gateway's own such as Kong's `apikey`);
    the front forwards the key unchanged, and to the spine as `authorization: Bearer KEY`.
    `name`: what the operator calls it (`litellm`, `kong`): the from-side's name wherever the
    migration is shown — status, gates' messages, the dashboard — in place of "layered"; it is
    not part of what the endpoint is (two plans naming one URL differently migrate the same one)."""

    http: str
    api_key_header: str = DEFAULT_API_KEY_HEADER
    name: str = field(default="", compare=False)

    def describe(self) -> str:
        return f"{self.http} (key in {self.api_key_header})"

    def label(self) -> str:
        """The from-side's name: `name`, else `legacy HOST:PORT`."""
        return self.name or f"legacy {urllib.parse.urlsplit(self.http).netloc}"


# What the from-side is called where no plan names a foreign endpoint: spine's own layered stack.
LAYERED_SIDE = "layered"


def from_side(legacy: LegacyEndpoint | None) -> str:
    """What a migration moves traffic away from, in words: the plan's legacy endpoint, else layered."""
    return legacy.label() if legacy is not None else LAYERED_SIDE


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


def name_problem(name: object) -> str | None:
    """What is wrong with a `legacy.name`, if anything: a short word to show, not a sentence."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        return f"a short name such as litellm or kong (letters, digits, '.', '_', '-'; at most 40), got {name!r}"
    return None


def endpoint(url: str, api_key_header: str = DEFAULT_API_KEY_HEADER) -> LegacyEndpoint:
    """A checked LegacyEndpoint (ValueError naming every problem), its URL without a trailing slash."""
    problems = legacy_problems(url, api_key_header)
    if problems:
        raise ValueError("; ".join(f"legacy {field}: {problem}" for field, problem in problems))
    return LegacyEndpoint(url.rstrip("/"), api_key_header)
