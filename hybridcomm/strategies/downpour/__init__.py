"""Downpour SGD (Dean et al. 2012): an asynchronous parameter server sharded
over server processes, the workers' client, model-parallel replicas as
pipelines of stages, and the small TCP protocol between them (no pickle).

May import: what every strategy may (strategies/__init__.py); it needs only
``base`` and ``config``.
"""

from .client import DownpourSGD, init_downpour, serve
from .pipeline import DownpourStage

__all__ = ["DownpourSGD", "DownpourStage", "init_downpour", "serve"]
