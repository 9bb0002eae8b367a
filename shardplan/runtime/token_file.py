"""The token file of `[data] path`: the width of its ids and what makes it usable.

Torch-free: the launcher runs `check` before torchrun starts (cli/run_cmd.py), so a bad file
is refused as bad input (exit 2) in a second instead of failing every rank; each rank runs
the same tests as it opens the file (runtime/data.py `FileTokens`).
"""

from __future__ import annotations

import os

from ..io.files import unreadable_path_kind

WIDTHS = {"uint16": 2, "uint32": 4}  # bytes per token id
# The launcher reads at most this much of the file for ids outside the vocabulary: a file
# written with another dtype shows it in its first tokens, and 256 MiB takes a fraction of a
# second; the ranks check every window they read (runtime/data.py `FileTokens.sample`).
SCAN_BYTES = 256 * 2**20
_SCAN_CHUNK = 16 * 2**20  # read and compared a piece at a time: the launcher holds no more


def token_dtype(dtype: str, vocab_size: int) -> str:
    """`data.dtype`, with "auto" made concrete: uint16 when every id of the vocabulary fits."""
    if dtype != "auto":
        return dtype
    return "uint16" if vocab_size <= 2**16 else "uint32"


def size_problem(shown: str, size: int, dtype: str, seq_len: int) -> str | None:
    """Why a file of `size` bytes cannot feed sequences of `seq_len` tokens (None: it can)."""
    width = WIDTHS[dtype]
    if size % width:
        return (f"{shown}: {size:,} bytes is not a whole number of {dtype} token ids ({width} bytes each); "
                "is data.dtype right?")
    count = size // width
    if count < seq_len + 1:
        return f"{shown}: holds {count:,} tokens, fewer than train.seq_len + 1 = {seq_len + 1}"
    return None


def kind_problem(path: str, shown: str) -> str | None:
    """Why `path` is no file of tokens, said before it is opened (None: a file, a directory or
    a path that does not exist, whose open() says what is wrong): a named pipe blocks open()
    until a writer comes, and a socket or a disk is no token file."""
    kind = unreadable_path_kind(path)
    return f"{shown}: is {kind}, not a file of token ids" if kind else None


def vocabulary_problem(shown: str, token: int, position: int, vocab_size: int) -> str:
    return (f"{shown}: token {token} at position {position} is outside the vocabulary ({vocab_size}); "
            "is data.dtype right?")


def check(path: str, shown: str, dtype: str, vocab_size: int, seq_len: int, scan_bytes: int = SCAN_BYTES) -> str | None:
    """The first problem of the token file at `path` (`shown` as the user wrote it), or None:
    unreadable, a size that is not whole tokens, too few tokens, or an id outside the
    vocabulary in its first `scan_bytes`."""
    import numpy as np  # `run` requires it (cli/run_cmd.py `_require_torch`)

    dtype = token_dtype(dtype, vocab_size)
    width = WIDTHS[dtype]
    ids_type = np.dtype(dtype).newbyteorder("<")
    problem = kind_problem(path, shown)
    if problem:
        return problem
    try:
        with open(path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            problem = size_problem(shown, size, dtype, seq_len)
            if problem:
                return problem
            count = min(size, scan_bytes) // width  # token ids scanned
            position = 0
            while position < count:
                data = handle.read(min(_SCAN_CHUNK // width, count - position) * width)
                ids = np.frombuffer(data[:len(data) - len(data) % width], dtype=ids_type)
                if not ids.size:  # the file shrank meanwhile
                    break
                outside = np.flatnonzero(ids >= vocab_size)
                if outside.size:
                    first = int(outside[0])
                    return vocabulary_problem(shown, int(ids[first]), position + first, vocab_size)
                position += ids.size
    except OSError as exc:
        return f"{shown}: cannot read: {exc.strerror or exc}"
    return None
