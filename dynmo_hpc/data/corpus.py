"""The training text as bytes, and the checks it must pass: shared by the ranks and preflight.

Why one module for both: :mod:`dynmo_hpc.launch.preflight` refuses a bad ``data.path`` before
any rank starts, and :mod:`dynmo_hpc.data.batches` meets the same file on every rank (a file can
change between submit and start). Both call these functions, so they refuse the same files with
the same messages. Pure Python: no torch or numpy, so preflight stays cheap to import.

What is accepted: a non-empty UTF-8 text file without NUL bytes (the model is byte-level, so any
UTF-8 text works). Latin-1 or other legacy encodings are refused rather than guessed: the same
bytes would train a different model than the user meant, and converting once is easy.
"""

from __future__ import annotations

from pathlib import Path

from dynmo_hpc.errors import ConfigError


def default_corpus_text() -> str:
    """CPython's bundled documentation topics, in a stable (sorted) order."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


def read_corpus(path: str | None) -> bytes:
    """The corpus as UTF-8 bytes: the file at ``path``, or the default text when None.

    Raises:
        ConfigError: the file is missing, a directory, unreadable, empty, binary (NUL bytes) or
            not UTF-8; the message names ``data.path`` and the fix.
    """
    if path is None:
        return default_corpus_text().encode("utf-8")
    where = f"data.path={path!r}"
    p = Path(path)
    try:
        if p.is_dir():
            raise ConfigError(f"{where} is a directory; HINT: give one UTF-8 text file, or null")
        raw = p.read_bytes()
    except FileNotFoundError:
        raise ConfigError(
            f"{where} does not exist; HINT: give a UTF-8 text file, or null for the default text"
        ) from None
    except OSError as exc:
        raise ConfigError(
            f"{where} cannot be read ({exc.strerror}); HINT: check its permissions"
        ) from None
    if not raw:
        raise ConfigError(f"{where} is empty; HINT: give a file with text in it, or null")
    nul = raw.find(b"\0")
    if nul >= 0:
        raise ConfigError(
            f"{where} has a NUL byte at offset {nul}: a binary file, not text; HINT: train on "
            "a UTF-8 text file"
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{where} is not UTF-8 text (byte {exc.start}: {raw[exc.start : exc.start + 1]!r}); "
            "HINT: convert it, e.g. iconv -f latin1 -t utf-8 IN > OUT"
        ) from None
    # Universal newlines, as text-mode reading always gave: CRLF and CR files train on "\n".
    return text.replace("\r\n", "\n").replace("\r", "\n").encode("utf-8")


def split_sizes(num_bytes: int, val_fraction: float, seq_len: int) -> tuple[int, int]:
    """(train, validation) byte counts of a corpus; raises if a split cannot give a sequence.

    A non-empty split needs at least ``seq_len + 2`` bytes: one sequence of ``seq_len + 1``
    tokens (inputs and shifted targets) and at least one start position to draw.

    Raises:
        ConfigError: the training split is empty, or a non-empty split is too short.
    """
    num_val = int(num_bytes * val_fraction)
    num_train = num_bytes - num_val
    need = seq_len + 2
    for name, size in (("training", num_train), ("validation", num_val)):
        if size and size < need:
            raise ConfigError(
                f"the {name} split has {size} bytes but model.seq_len={seq_len} needs at least "
                f"{need} (the corpus has {num_bytes} bytes, data.val_fraction={val_fraction}); "
                "HINT: use a longer text file, a smaller model.seq_len"
                + (", or data.val_fraction=0" if name == "validation" else "")
            )
    if num_train == 0:
        raise ConfigError(
            "the training split is empty; HINT: lower data.val_fraction or use a longer file"
        )
    return num_train, num_val
