"""Exceptions hybridcomm raises, so callers can catch ours apart from torch's."""


class HybridCommError(RuntimeError):
    """Bad input or a failed collective (the message says which rank and why)."""


class HybridCommTimeout(HybridCommError, TimeoutError):
    """A peer did not answer within the timeout (dead, hung, or never arrived)."""
