"""The admin token (`services.common.admin_token`), under the name the controller's code uses."""

from services.common.admin_token import (
    ENV_VAR,
    MIN_LENGTH,
    bearer,
    read_admin_token,
    read_secret_file,
    token_matches,
)

__all__ = ["ENV_VAR", "MIN_LENGTH", "bearer", "read_admin_token", "read_secret_file", "token_matches"]
