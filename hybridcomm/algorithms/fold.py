"""Non-power-of-two world sizes: fold the extra ranks in and out.

With P = core + extra (core the largest power of two <= P), extra rank
core + i first sends its whole buffer to rank i, which adds it in; ranks
0..core-1 then run the power-of-two algorithm; finally rank i sends the
result back to rank core + i (a copy). Two extra steps, on ``extra`` ranks
only, as in MPICH's recursive doubling.
"""

from __future__ import annotations

from typing import Callable, List

from .schedule import Recv, Schedule, Send, Step, build, check_args, largest_power_of_two, step

CoreSteps = Callable[[int, int, int], List[Step]]


def folded(name: str, core_steps: CoreSteps, rank: int, world_size: int, numel: int) -> Schedule:
    """Schedule of ``core_steps`` (defined for power-of-two sizes) at any size."""
    check_args(rank, world_size, numel)
    core = largest_power_of_two(world_size)
    extra = world_size - core
    whole = (0, numel)
    if rank >= core:  # folded out of the core: hand in, wait for the result
        partner = rank - core
        steps = [step([Send(partner, *whole)]), step((), [Recv(partner, *whole, reduce=False)])]
    else:
        partner = rank + core if rank < extra else None
        steps = []
        if partner is not None:
            steps.append(step((), [Recv(partner, *whole, reduce=True)]))
        steps += core_steps(rank, core, numel)
        if partner is not None:
            steps.append(step([Send(partner, *whole)]))
    return build(name, rank, world_size, numel, steps=steps)
