"""Doing, not deciding: everything between a bucket's buffer and the wire.

The transports (gloo through torch.distributed, NCCL through CuPy), the
issuing thread and the ordered channel, the schedule executor, the engine that
issues a plan's buckets in order, the one reduction dispatch shared by the
engine and ``all_reduce``, host-side control collectives, the calibration probe,
top-k compression state, sparse gradients and the summation servers.

May import: ``base``, ``config``, ``algorithms``, ``gpu``, ``plan``, and the
Triton kernels (``hybridcomm.kernels``).
"""
