"""Benchmarks behind ``ray-checkfreq bench NAME``.

Each module here named in ``BENCHMARKS`` exposes ``add_arguments(parser)`` and
``run(args) -> int``; it prints a table and, with ``--json OUT``, writes its figures.
"""

BENCHMARKS = {
    "store": "ray_checkfreq.bench.store",
    "persist": "ray_checkfreq.bench.persist",
    "codec": "ray_checkfreq.bench.codec",
    "iterator": "ray_checkfreq.bench.iterator",
    "stall": "ray_checkfreq.bench.stall",
    "overhead": "ray_checkfreq.bench.overhead",
    "restore": "ray_checkfreq.bench.restore",
    "ray": "ray_checkfreq.bench.ray_bench",
    "all": "ray_checkfreq.bench.all",
}
