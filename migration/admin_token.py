"""The admin token: read from a file or SPINE_ADMIN_TOKEN, never from argv.

Command lines are visible to every user of the machine (`ps`), so a token on argv is a
leaked token. Files and the environment are not — as long as the file is the user's alone:
a token file readable by group or others is refused, as ssh refuses such a private key.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from pathlib import Path

from services.common import ConfigError

ENV_VAR = "SPINE_ADMIN_TOKEN"
MIN_LENGTH = 16


def read_admin_token(path: str | None, env: Mapping[str, str] | None = None) -> str:
    """The token from `path` if given, else from $SPINE_ADMIN_TOKEN; ConfigError if neither."""
    env = os.environ if env is None else env
    if path:
        try:
            mode = stat.S_IMODE(os.stat(path).st_mode)
            token = Path(path).read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise ConfigError(f"--admin-token-file: cannot read {path}: {exc.strerror}") from None
        if mode & 0o077:  # like ssh with a private key: a token others can read is no secret
            raise ConfigError(f"--admin-token-file {path}: readable by other users (mode {mode:04o}); "
                              f"chmod 600 {path}")
        where = f"--admin-token-file {path}"
    else:
        token = env.get(ENV_VAR, "").strip()
        where = f"${ENV_VAR}"
        if not token:
            raise ConfigError(f"no admin token: pass --admin-token-file FILE or set ${ENV_VAR}")
    if len(token) < MIN_LENGTH:
        raise ConfigError(f"{where}: the admin token must be at least {MIN_LENGTH} characters, "
                          f"got {len(token)}")
    return token
