"""Test support shipped with the package: the simulated CUDA runtime (simgpu)."""
