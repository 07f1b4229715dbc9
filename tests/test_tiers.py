"""Every test module has a tier (tests/conftest.py), and the tiers split the suite."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import TIERS

TESTS = Path(__file__).resolve().parent


def test_every_test_module_is_in_exactly_one_tier() -> None:
    listed = [module for modules in TIERS.values() for module in modules]
    assert sorted(listed) == sorted(set(listed)), "a module in two tiers"
    assert sorted(p.name for p in TESTS.glob("test_*.py")) == sorted(listed)


def _collected(*args: str) -> set[str]:
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args,
                           str(TESTS / "test_layers.py"), str(TESTS / "test_ray_policy.py"),
                           str(TESTS / "test_examples.py")],
                          capture_output=True, text=True, timeout=120, cwd=TESTS.parent)
    assert done.returncode in (0, 5), done.stdout[-2000:] + done.stderr[-2000:]
    return {line for line in done.stdout.splitlines() if "::" in line}


def test_a_tier_selects_its_modules_and_the_tiers_split_them() -> None:
    every = _collected()
    tiers = {tier: _collected("-m", tier) for tier in TIERS}
    assert tiers["tooling"] and all(t.startswith("tests/test_layers.py") or t.startswith("tests/test_examples.py")
                                    for t in tiers["tooling"])
    assert {t.split("::")[0] for t in tiers["chaos"]} == {"tests/test_ray_policy.py", "tests/test_examples.py"}
    assert not tiers["unit"] and not tiers["integration"]
    assert sorted(t for tier in tiers.values() for t in tier) == sorted(every)  # each test in one tier
