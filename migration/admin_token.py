"""The admin token (`services.common.admin_token`), under the name the controller's code uses."""

import urllib.parse

from services.common.admin_token import (
    ENV_VAR,
    MIN_LENGTH,
    bearer,
    read_admin_token,
    read_secret_file,
    token_matches,
)

__all__ = ["ENV_VAR", "MIN_LENGTH", "bearer", "dashboard_link", "read_admin_token", "read_secret_file",
           "token_matches"]


def dashboard_link(url: str, token: str) -> str:
    """The dashboard's `url` with `token` in its fragment (`#token=...`), so a click opens it
    unlocked: a browser never sends a fragment to a server, so the token reaches no server's
    log or proxy; the page reads it, keeps it for the tab and takes it out of the address bar.
    Printed on the operator's screen only (never through logging)."""
    return f"{url.split('#', 1)[0]}#token={urllib.parse.quote(token, safe='')}"
