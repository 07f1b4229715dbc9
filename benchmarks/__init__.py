"""Benchmarks behind ``ray-checkfreq bench NAME``.

Each module here named in ``BENCHMARKS`` exposes ``add_arguments(parser)`` and
``run(args) -> int``; it prints a table and, with ``--json OUT``, writes its figures.
"""

BENCHMARKS = {
    "store": "benchmarks.store",
    "persist": "benchmarks.persist",
    "codec": "benchmarks.codec",
    "iterator": "benchmarks.iterator",
    "stall": "benchmarks.stall",
    "overhead": "benchmarks.overhead",
    "restore": "benchmarks.restore",
    "ray": "benchmarks.ray_bench",
    "all": "benchmarks.all",
}
