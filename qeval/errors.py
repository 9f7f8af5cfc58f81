"""One exception type for every bad input: the CLI prints its message and exits non-zero."""


class QevalError(Exception):
    """A problem the user can act on; its message is shown as-is, without a traceback."""

    exit_code = 2


class StoreFormatError(QevalError):
    """A store (or llama.cpp logits file) is malformed, truncated, or corrupted."""


class MismatchError(QevalError):
    """Reference and candidate cannot be compared (vocab, n_ctx, tokens, ...)."""


class WriteFailed(QevalError):
    """Writing a file failed (a full disk, a quota, an I/O error) and the file was left as it was before the
    write: what was written earlier is kept and a rerun continues from it. `errno` is the OSError's, `path`
    the file and `size` the bytes the failed write needed (None when unknown), so that a caller can name what
    ran out and how much more it needs."""

    def __init__(self, message: str, path=None, errno: int | None = None, size: int | None = None):
        # every argument but the message optional: pickle (a Ray task's error) rebuilds it from the message alone,
        # then restores the attributes
        super().__init__(message)
        self.path, self.errno, self.size = path, errno, size
