"""How an upstream's answer without `usage` is counted: with its model's tokenizer where the
config names one (`tokenizer_file`, a Hugging Face tokenizer.json), else estimated
(`services.common.token_estimate`). Loaded once at start, so a file that cannot be read is a
config error then, not a surprise at the first answer without usage."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from services.common import ConfigError
from services.common.token_estimate import ESTIMATE, TOKENIZER, estimate_tokens


class TokenCounter:
    """One upstream's way of counting a text's tokens; `name` says which it is."""

    def __init__(self, path: Path | None, where: str) -> None:
        self._tokenizer: Any = None
        if path is not None:
            try:
                from tokenizers import Tokenizer
            except ImportError:
                raise ConfigError(f"{where}.tokenizer_file needs the tokenizers package "
                                  "(pip install 'spine[hf]')") from None
            try:
                self._tokenizer = Tokenizer.from_file(str(path))
            except Exception as error:  # the library's own error types vary: say what it said
                raise ConfigError(f"{where}.tokenizer_file: cannot read {path} as a tokenizer.json: {error}") from None
        self.name = TOKENIZER if self._tokenizer is not None else ESTIMATE

    def count(self, text: str) -> int:
        if not text:
            return 0
        if self._tokenizer is None:
            return estimate_tokens(text)
        return len(self._tokenizer.encode(text, add_special_tokens=False).ids)
