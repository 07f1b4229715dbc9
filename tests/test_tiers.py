"""Every test module has a tier (tests/conftest.py), and the tiers split the suite."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import TIERS

TESTS = Path(__file__).resolve().parent


def test_every_test_module_is_in_exactly_one_tier() -> None:
    listed = [module for modules in TIERS.values() for module in modules]
    assert sorted(listed) == sorted(set(listed)), "a module in two tiers"
    assert sorted(p.name for p in TESTS.glob("test_*.py")) == sorted(listed)


# One child process collects every selection (pytest.main per selection: the imports of
# torch and Ray are paid once).
_COLLECT = """
import json, sys, pytest

class Items:
    def pytest_collection_finish(self, session):
        self.ids = [item.nodeid for item in session.items]

found = {}
for name, extra in json.loads(sys.argv[1]).items():
    items = Items()
    code = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", *extra, *sys.argv[2:]], plugins=[items])
    assert code in (0, 5), (name, code)
    found[name] = items.ids
print("COLLECTED " + json.dumps(found))
"""


def _collect_all(selections: dict[str, list[str]]) -> dict[str, set[str]]:
    modules = [str(TESTS / "test_layers.py"), str(TESTS / "test_ray_policy.py"), str(TESTS / "test_examples.py")]
    done = subprocess.run([sys.executable, "-c", _COLLECT, json.dumps(selections), *modules],
                          capture_output=True, text=True, timeout=180, cwd=TESTS.parent)
    line = next((line for line in done.stdout.splitlines() if line.startswith("COLLECTED ")), None)
    assert done.returncode == 0 and line, done.stdout[-2000:] + done.stderr[-2000:]
    return {name: set(ids) for name, ids in json.loads(line.removeprefix("COLLECTED ")).items()}


def test_a_tier_selects_its_modules_and_the_tiers_split_them() -> None:
    collected = _collect_all({"every": [], **{tier: ["-m", tier] for tier in TIERS}})
    every, tiers = collected.pop("every"), collected
    assert tiers["tooling"] and all(t.startswith("tests/test_layers.py") or t.startswith("tests/test_examples.py")
                                    for t in tiers["tooling"])
    assert {t.split("::")[0] for t in tiers["chaos"]} == {"tests/test_ray_policy.py", "tests/test_examples.py"}
    assert not tiers["unit"] and not tiers["integration"]
    assert sorted(t for tier in tiers.values() for t in tier) == sorted(every)  # each test in one tier
