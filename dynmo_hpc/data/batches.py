"""Batches that depend only on (seed, step, microbatch), from text bytes or token ids.

Why byte-level by default: no tokenizer download on an offline cluster, a fixed vocabulary of
256, and any UTF-8 file works; tokenized data (:mod:`.source`) samples windows the same way.
Why seed-and-step batches: every pipeline stage (and the single-process reference) can build
the same microbatch locally, so targets never travel between ranks and a restarted or reshaped
job sees exactly the batches it would have seen.

The default corpus is the documentation text that ships inside CPython (``pydoc_data.topics``,
about 0.8 MB of English prose and code samples), so a fresh machine trains on real text offline.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dynmo_hpc.config import DataSection, JobConfig
from dynmo_hpc.data.corpus import default_corpus_text, read_corpus
from dynmo_hpc.data.source import TokenSequence, open_source

__all__ = ["TextDataset", "default_corpus_text", "load_corpus_bytes"]


def load_corpus_bytes(data: DataSection) -> np.ndarray:
    """The corpus as a uint8 array of UTF-8 bytes (checked by :func:`corpus.read_corpus`)."""
    return np.frombuffer(read_corpus(data.path), dtype=np.uint8).copy()


@dataclass(frozen=True)
class TextDataset:
    """Train/validation split of a token sequence, with deterministic batch sampling.

    The splits are byte arrays for text, or memory-mapped token ids
    (:func:`~dynmo_hpc.data.source.open_source` says which); sampling is the same rule for all.
    """

    train: TokenSequence
    val: TokenSequence
    seq_len: int

    @classmethod
    def from_config(
        cls, data: DataSection, seq_len: int, *, out_dir: str | None = None
    ) -> TextDataset:
        """The data of ``data``; ``out_dir`` (``job.out_dir``) holds a ``data.tokenizer`` cache."""
        train, val = open_source(data, seq_len, out_dir)
        return cls(train=train, val=val, seq_len=seq_len)

    @classmethod
    def for_job(cls, cfg: JobConfig) -> TextDataset:
        """The job's data, windows of ``model.seq_len``."""
        return cls.from_config(cfg.data, cfg.model.seq_len, out_dir=cfg.job.out_dir)

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
