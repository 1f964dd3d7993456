"""Tests run ranks as forked processes (no re-import of torch per rank) over gloo."""

from hybridcomm.tools.launch import launch


def run_ranks(
    world_size: int,
    fn,
    *args,
    timeout: float = 180,
    pg_timeout: float = 60,
    allow_errors: bool = False,
):
    """``fn(rank, world_size, *args)`` on ``world_size`` gloo processes; their results."""
    return launch(
        fn,
        world_size,
        *args,
        backend="gloo",
        timeout=timeout,
        pg_timeout=pg_timeout,
        start_method="fork",
        allow_errors=allow_errors,
    )
