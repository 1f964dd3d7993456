"""The ``hybridcomm`` logger: its level from ``HYBRIDCOMM_LOG_LEVEL`` (default INFO),
and a stderr handler (``[hybridcomm r0] ...``) that stays silent once the
application configures logging itself (then records reach its handlers)."""

from __future__ import annotations

import logging

from . import env


class _RankFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        try:
            import torch.distributed as dist

            record.rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else "-"
        except Exception:
            record.rank = "-"
        return True


class _FallbackHandler(logging.StreamHandler):
    """Prints only while the root logger has no handlers of the application's."""

    def emit(self, record: logging.LogRecord) -> None:
        if not logging.getLogger().handlers:
            super().emit(record)


class _Formatter(logging.Formatter):
    """``[hybridcomm r0] message``: one prefix (messages that name the library
    themselves, for the application's own handlers, lose that word here)."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        return text.replace("] hybridcomm: ", "] ", 1)


def setup() -> logging.Logger:
    """Configure and return the ``hybridcomm`` logger (idempotent)."""
    log = logging.getLogger("hybridcomm")
    log.setLevel(env.get("HYBRIDCOMM_LOG_LEVEL"))
    if not any(isinstance(h, _FallbackHandler) for h in log.handlers):
        handler = _FallbackHandler()
        handler.addFilter(_RankFilter())
        handler.setFormatter(_Formatter("[hybridcomm r%(rank)s] %(message)s"))
        log.addHandler(handler)
    return log
