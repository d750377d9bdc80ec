"""Where a batch comes from: the training data, prepared or read, and the batches every rank cuts.

- :mod:`~dynmo_hpc.data.corpus`: reading a text corpus and holding out the validation split.
- :mod:`~dynmo_hpc.data.batches`: a batch as a pure function of (seed, step, microbatch), so a
  resumed run sees exactly the batches an uninterrupted run would.
- :mod:`~dynmo_hpc.data.source`: what ``data.path`` names (text, a ``.bin`` token file, a
  prepared directory, or text with ``data.tokenizer``) opened as train and validation splits.
- :mod:`~dynmo_hpc.data.tokens`, :mod:`~dynmo_hpc.data.shards`: flat token files and the
  sharded directories prepare-data writes, memory-mapped.
- :mod:`~dynmo_hpc.data.text_files`, :mod:`~dynmo_hpc.data.prepare`: ``dynmo-hpc prepare-data``
  (check, tokenize in bounded memory, write atomically); :mod:`~dynmo_hpc.data.cache`: the same,
  once, for a job's ``data.tokenizer``.
"""
