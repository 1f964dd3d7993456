"""hybridcomm inside the frameworks people train with (docs/INTEGRATIONS.md).

Each submodule imports its framework on import; none of them is a dependency
of hybridcomm (``pip install hybridcomm[integrations]`` brings them):

- ``hybridcomm.integrations.lightning``: ``HybridStrategy`` for PyTorch Lightning.
- ``hybridcomm.integrations.accelerate``: Hugging Face Accelerate.
- ``hybridcomm.integrations.transformers``: ``transformers.Trainer``.

May import: the fronts (``optimizer``, ``ddp``) and everything below them,
through their public methods only; not ``strategies`` or ``tools``.
"""
