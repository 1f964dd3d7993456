"""Deciding, not doing: the alpha-beta-gamma cost model and its fit, the
per-bucket planner (algorithm, fusion, split, issue order, the forward-mode
deferral) and its buffers' layout, the automatic algorithm choice and the
one-line verdict. Pure functions of sizes, windows and coefficients: nothing
here touches a network.

May import: ``base``, ``config``, ``algorithms``.
"""
