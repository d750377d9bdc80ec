"""Text files for prepare-data: checked whole, then streamed in pieces, never held in memory.

Why a check pass first: the tokenizer consumes the text in Rust, where an error half-way (a
binary file, a Latin-1 byte) would surface as an opaque failure after minutes of work. A pass over
the bytes in fixed-size chunks refuses such a file up front with one line naming the file and the
offset; it costs a read of the corpus, small beside tokenizing it.

What is accepted is what byte-level training accepts (:mod:`.corpus`): non-empty UTF-8 without
NUL bytes. Pieces are read in text mode with universal newlines, so CRLF files train on ``\\n``.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterator
from pathlib import Path

from dynmo_hpc.errors import DataError

CHECK_CHUNK_BYTES = 8 << 20
"""Bytes read at a time by the check pass."""

PIECE_CHARS = 1 << 13
"""Characters per streamed piece (extended to the end of its line, up to :data:`MAX_LINE_CHARS`):
small pieces tokenize faster (measured 1.4 against 0.7 MB/s for 1 MiB pieces) and in parallel."""

MAX_LINE_CHARS = 1 << 20
"""A line longer than this is cut: a file with no newlines still streams in bounded pieces."""


def check_text_file(path: Path) -> int:
    """The size in bytes of ``path``, a non-empty UTF-8 text file without NUL bytes.

    Raises:
        DataError: the file is missing, a directory, unreadable, empty, binary or not UTF-8.
    """
    where = f"{str(path)!r}"
    if path.is_dir():
        raise DataError(f"{where} is a directory; HINT: give UTF-8 text files")
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    try:
        with open(path, "rb") as handle:
            while chunk := handle.read(CHECK_CHUNK_BYTES):
                nul = chunk.find(b"\0")
                if nul >= 0:
                    raise DataError(
                        f"{where} has a NUL byte at offset {offset + nul}: a binary file, not "
                        "text; HINT: give UTF-8 text files"
                    )
                try:
                    decoder.decode(chunk)
                except UnicodeDecodeError as exc:
                    raise DataError(
                        f"{where} is not UTF-8 text (near byte {offset + exc.start}); HINT: "
                        "convert it, e.g. iconv -f latin1 -t utf-8 IN > OUT"
                    ) from None
                offset += len(chunk)
            try:
                decoder.decode(b"", final=True)
            except UnicodeDecodeError:
                raise DataError(
                    f"{where} ends inside a UTF-8 character (truncated?); HINT: give whole "
                    "UTF-8 text files"
                ) from None
    except FileNotFoundError:
        raise DataError(f"{where} does not exist; HINT: give UTF-8 text files") from None
    except OSError as exc:
        raise DataError(f"{where} cannot be read ({exc.strerror}); HINT: check it") from None
    if offset == 0:
        raise DataError(f"{where} is empty; HINT: give files with text in them")
    return offset


def check_text_files(paths: list[Path]) -> list[int]:
    """Each file's size in bytes, after :func:`check_text_file` on every one.

    Raises:
        DataError: no files, or one of them is unusable.
    """
    if not paths:
        raise DataError("no input text files; HINT: name at least one UTF-8 text file")
    return [check_text_file(p) for p in paths]


def text_pieces(paths: list[Path], piece_chars: int = PIECE_CHARS) -> Iterator[str]:
    """The files' text, in order, as pieces of about ``piece_chars`` characters ending at a
    line end (or cut at :data:`MAX_LINE_CHARS` characters on a very long line)."""
    for path in paths:
        with open(path, encoding="utf-8", newline=None) as handle:
            while piece := handle.read(piece_chars):
                if not piece.endswith("\n"):
                    piece += handle.readline(MAX_LINE_CHARS)
                yield piece
