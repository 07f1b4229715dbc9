"""The one parser and formatter of the names that carry numbers: checkpoint directories
``step-<step>-g<writer generation>-<8 hex>`` and writer markers ``gen-<generation>.json``.

Both numbers have a bounded width, the same for every name that holds them: a step has
12 to 18 digits (``MAX_STEP``), a writer generation 6 to 12 in a directory name and
exactly 12 in a marker (``MAX_GENERATION``). A name that does not parse is not a
checkpoint and not a marker: it is ignored, never taken as the newest writer. Nothing
is formatted that would not parse back.
"""

from __future__ import annotations

import re

STEP_DIGITS = 18
GENERATION_DIGITS = 12
MAX_STEP = 10**STEP_DIGITS - 1
MAX_GENERATION = 10**GENERATION_DIGITS - 1
# Without "g" (written before fencing): generation 0.
CHECKPOINT_DIR = re.compile(
    rf"^step-(?P<step>[0-9]{{12,{STEP_DIGITS}}})-(?:g(?P<generation>[0-9]{{6,{GENERATION_DIGITS}}})-)?"
    r"(?P<suffix>[0-9a-f]{8})$"
)
MARKER = re.compile(rf"^gen-(?P<generation>[0-9]{{{GENERATION_DIGITS}}})\.json$")


def parse_checkpoint_dir(name: str) -> tuple[int, int] | None:
    """(step, writer generation) of a checkpoint directory name; None if it is not one."""
    match = CHECKPOINT_DIR.match(name)
    if match is None:
        return None
    return int(match["step"]), int(match["generation"] or 0)


def checkpoint_dir_name(step: int, generation: int, suffix: str) -> str:
    if not 0 <= step <= MAX_STEP or not 0 <= generation <= MAX_GENERATION:
        raise ValueError(f"step {step} / writer generation {generation} out of range "
                         f"(at most {MAX_STEP} / {MAX_GENERATION})")
    name = f"step-{step:012d}-g{generation:06d}-{suffix}"
    assert parse_checkpoint_dir(name) == (step, generation), name
    return name


def parse_marker(name: str) -> int | None:
    """The generation a writer marker's file name holds; None if it is not a marker."""
    match = MARKER.match(name)
    return None if match is None else int(match["generation"])


def marker_name(generation: int) -> str:
    if not 1 <= generation <= MAX_GENERATION:
        raise ValueError(f"writer generation {generation} out of range (1 to {MAX_GENERATION})")
    return f"gen-{generation:0{GENERATION_DIGITS}d}.json"
