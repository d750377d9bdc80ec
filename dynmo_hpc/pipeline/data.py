"""Real English text, byte-level tokens, and batches that depend only on (seed, step).

Why byte-level: no tokenizer download on an offline cluster, a fixed vocabulary of 256, and any
UTF-8 file works. Why seed-and-step batches: every pipeline stage (and the single-process
reference) can build the same microbatch locally, so targets never travel between ranks and a
restarted or reshaped job sees exactly the batches it would have seen.

The default corpus is the documentation text that ships inside CPython (``pydoc_data.topics``,
about 0.8 MB of English prose and code samples), so a fresh machine trains on real text offline.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dynmo_hpc.config import DataSection


def default_corpus_text() -> str:
    """CPython's bundled documentation topics, in a stable (sorted) order."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


def load_corpus_bytes(data: DataSection) -> np.ndarray:
    """The corpus as a uint8 array of UTF-8 bytes."""
    if data.path is None:
        text = default_corpus_text()
    else:
        path = Path(data.path)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise FileNotFoundError(
                f"data.path={data.path!r} does not exist; give a UTF-8 text file or null"
            ) from None
        except UnicodeDecodeError as exc:
            raise ValueError(
                f"data.path={data.path!r} is not UTF-8 text ({exc}); convert it or pick another"
            ) from None
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).copy()


@dataclass(frozen=True)
class TextDataset:
    """Train/validation split of a byte corpus, with deterministic batch sampling."""

    train: np.ndarray
    val: np.ndarray
    seq_len: int

    @classmethod
    def from_config(cls, data: DataSection, seq_len: int) -> TextDataset:
        corpus = load_corpus_bytes(data)
        num_val = int(len(corpus) * data.val_fraction)
        train, val = corpus[: len(corpus) - num_val], corpus[len(corpus) - num_val :]
        for name, split in (("train", train), ("validation", val)):
            if len(split) and len(split) <= seq_len + 1:
                raise ValueError(
                    f"the {name} split has {len(split)} bytes but model.seq_len={seq_len} "
                    "needs more; use a longer text file or a smaller seq_len"
                )
        if len(train) == 0:
            raise ValueError("the training split is empty; lower data.val_fraction")
        return cls(train=train, val=val, seq_len=seq_len)

    def batch(
        self, seed: int, step: int, microbatch: int, batch_size: int, split: str = "train"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, targets), each (B, T) int64, a pure function of its arguments."""
        source = self.train if split == "train" else self.val
        if len(source) == 0:
            raise ValueError(f"the {split} split is empty; raise data.val_fraction")
        # One generator per (seed, split, step, microbatch): independent of call order.
        split_id = 0 if split == "train" else 1
        rng = np.random.default_rng([seed, split_id, step, microbatch])
        starts = rng.integers(0, len(source) - self.seq_len - 1, size=batch_size)
        rows = np.stack([source[s : s + self.seq_len + 1] for s in starts]).astype(np.int64)
        chunk = torch.from_numpy(rows)  # (B, T + 1)
        return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()
