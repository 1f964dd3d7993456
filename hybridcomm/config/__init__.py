"""What the user sets: the environment variables (``env``), the logging setup
(``logs``) and :class:`~hybridcomm.config.config.SyncConfig`, the synchronizer's
arguments and environment read once and passed down.

May import: ``base``, ``algorithms`` (the algorithm names a variable may take).
"""
