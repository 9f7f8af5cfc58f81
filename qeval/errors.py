"""One exception type for every bad input: the CLI prints its message and exits non-zero."""


class QevalError(Exception):
    """A problem the user can act on; its message is shown as-is, without a traceback."""

    exit_code = 2


class StoreFormatError(QevalError):
    """A store (or llama.cpp logits file) is malformed, truncated, or corrupted."""


class MismatchError(QevalError):
    """Reference and candidate cannot be compared (vocab, n_ctx, tokens, ...)."""
