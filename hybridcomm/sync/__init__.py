"""The gradient synchronizer and its parts: the parameter registry, the bucket
memory, the bucket groups that own each bucket's phase, the pass tracker, the
used-parameter agreement, forward mode's pending parameters, the measurements
that feed re-planning, checkpoints of the plan, and the stall inspector.

May import: ``base``, ``config``, ``algorithms``, ``gpu``, ``plan``, ``comm`` and
the kernels.
"""
