"""The version, in one place (read statically by the build: pyproject.toml)."""

__version__ = "0.2.0"
