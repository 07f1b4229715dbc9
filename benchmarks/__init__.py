"""The benchmarks behind ``ray-checkfreq bench NAME`` (a repository folder, not in the wheel).

Each module named in ``BENCHMARKS`` exposes ``add_arguments(parser)`` and ``run(args) -> int``;
it prints a table and, with ``--json OUT``, writes its figures. harness.py is what they share
(clocks, interleaved rounds, JSON, the machine, loopback S3); cases.py declares each one for
``bench all`` and its report.
"""

from benchmarks.cases import BY_NAME, OTHER_MODULES

ORDER = ("store", "persist", "codec", "iterator", "stall", "overhead", "restore", "ray", "sharded", "goodput",
         "inplace", "all")
BENCHMARKS = {name: BY_NAME[name].module if name in BY_NAME else OTHER_MODULES[name] for name in ORDER}
