"""Where a batch comes from: the training text and the batches every rank cuts from it.

- :mod:`~dynmo_hpc.data.corpus`: reading the corpus file and holding out the validation split.
- :mod:`~dynmo_hpc.data.batches`: a batch as a pure function of (seed, step, microbatch), so a
  resumed run sees exactly the batches an uninterrupted run would.
"""
