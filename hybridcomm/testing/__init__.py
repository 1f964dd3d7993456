"""Test support shipped with the package: the simulated CUDA runtime (simgpu).

May import: anything but ``tools`` (it tests the units below it).
"""
