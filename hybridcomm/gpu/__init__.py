"""The device runtime: CUDA streams and events behind one small interface
(``runtime_for(device)``: the CUDA runtime, the simulated one under
``HYBRIDCOMM_SIMULATE_GPU=1``, or None for the host path), the planner's clock
on the device's timeline, and the optional CUDA C++ extension.

May import: ``base``, ``config``.
"""
