"""What a person runs beside training: the microbenchmark CLI
(``hybridcomm-bench``), the launcher, network namespaces for shaped links, and
the ``python -m hybridcomm`` commands.

May import: anything in hybridcomm.
"""
