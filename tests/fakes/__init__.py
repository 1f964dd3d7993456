"""Test doubles for the fast tier (tests/tiers.py): everything in the test's own process.

- ``network``: P ranks as threads over a fake wire that matches as NCCL does (per
  peer pair, FIFO, no tags) and moves bytes only when a side waits; the
  host-ordered transport contract on top (``FakeTransport``).
- ``buckets``: the production bucket group, engine and host channel over that wire,
  with plans made by hand.
- ``world``: a process group of one rank, for ``DistributedOptimizer`` itself.

The GPU's own double is the simulated CUDA runtime, ``hybridcomm.testing.simgpu``.
"""
