"""hybridcomm: per-layer hybrid all-reduce (butterfly + ring) for data-parallel PyTorch."""
from setuptools import find_packages, setup

setup(
    name="hybridcomm",
    version="0.1.0",
    description="Faster gradient synchronization for data-parallel PyTorch: per-layer "
                "butterfly/ring all-reduce overlapped with backward and the next forward",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.9",
    # `kernels/` is a generic name other PyPI packages use: install it only as
    # hybridcomm.kernels, never as a top-level module.
    packages=find_packages(include=["hybridcomm", "hybridcomm.*"]) + ["hybridcomm.kernels"],
    package_dir={"hybridcomm.kernels": "kernels"},
    # Any torch >= 2.1 works; the Makefile installs the CPU build itself so a
    # plain resolve never pulls a multi-GB CUDA wheel onto a CPU machine.
    install_requires=["torch>=2.1", "numpy"],
    extras_require={
        "test": ["pytest>=7", "triton>=3.0; platform_system == 'Linux'", "matplotlib", "coverage>=7"],
        "bench": ["matplotlib"],
        "cuda12": ["cupy-cuda12x>=13,<15", "nvidia-nccl-cu12", "triton>=3.0", "nvtx"],
        "cuda13": ["cupy-cuda13x>=13,<15", "nvidia-nccl-cu13", "triton>=3.0", "nvtx"],
    },
    entry_points={"console_scripts": ["hybridcomm-bench=hybridcomm.bench.cli:main"]},
    classifiers=["Programming Language :: Python :: 3", "Topic :: Scientific/Engineering"],
)
