"""README.md, docs/ and cluster/README.md stay true to the repository: every file they name
exists in it, every relative link resolves, nothing points outside it, and the defaults
they quote are the code's."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "cluster" / "README.md"]
FILE_NAME = re.compile(r"`([A-Za-z0-9_./-]+\.(?:py|md|yaml|sh|c))`")
# Bare module names are written relative to the package or one of its layers.
SEARCH_DIRS = [ROOT, ROOT / "docs", ROOT / "cluster", ROOT / "ray_checkfreq",
               *sorted(p for p in (ROOT / "ray_checkfreq").iterdir() if p.is_dir() and p.name != "__pycache__"),
               ROOT / "ray_checkfreq" / "storage" / "backends"]


def named_files(text: str) -> set[str]:
    return set(FILE_NAME.findall(text))


def missing_files(text: str) -> list[str]:
    return sorted(name for name in named_files(text) if not any((d / name).exists() for d in SEARCH_DIRS))


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_file_a_doc_names_exists(doc: Path) -> None:
    assert missing_files(doc.read_text()) == []


def test_a_renamed_module_is_caught() -> None:
    assert missing_files("see `engine/policy.py` and `engine/polcy.py`") == ["engine/polcy.py"]


# In the README a file is named by its path from the repository root.
REPO_PATH = re.compile(r"`([A-Za-z0-9_.-]+/[A-Za-z0-9_./-]*\.(?:py|md|yaml|sh|c|png|json|toml))`")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def missing_repo_paths(text: str) -> list[str]:
    return sorted(name for name in set(REPO_PATH.findall(text)) if not (ROOT / name).exists())


def broken_links(doc: Path) -> list[str]:
    targets = [t.split("#")[0] for t in LINK.findall(doc.read_text()) if not t.startswith(("http:", "https:", "#"))]
    return sorted(t for t in targets if not (doc.parent / t).resolve().exists())


def test_every_file_the_readme_names_exists() -> None:
    assert missing_repo_paths((ROOT / "README.md").read_text()) == []


def test_a_moved_file_in_the_readme_is_caught() -> None:
    assert missing_repo_paths("`examples/demo.py`, `docs/img/demo-timeline.png`, `examples/dmeo.py`") == [
        "examples/dmeo.py"]


@pytest.mark.parametrize("doc", DOCS + [ROOT / "README.md"], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(doc: Path) -> None:
    assert broken_links(doc) == []


def test_a_broken_link_is_caught(tmp_path: Path) -> None:
    (tmp_path / "there.md").write_text("x")
    doc = tmp_path / "doc.md"
    doc.write_text("[a](there.md) [b](there.md#part) [c](gone.md) [d](https://example.org/x)")
    assert broken_links(doc) == ["gone.md"]


@pytest.mark.parametrize("doc", DOCS + [ROOT / "README.md"], ids=lambda p: str(p.relative_to(ROOT)))
def test_no_doc_points_outside_the_repository(doc: Path) -> None:
    text = doc.read_text()
    for outside in ("../shared", "/work/shared", "DESIGN.md"):
        assert outside not in text, f"{doc.name} points to {outside}, which users do not have"


def test_the_index_links_every_doc() -> None:
    index = (ROOT / "docs" / "README.md").read_text()
    for doc in (ROOT / "docs").glob("*.md"):
        if doc.name != "README.md":
            assert f"]({doc.name})" in index, f"docs/README.md does not link {doc.name}"
    for target in re.findall(r"\]\(([^)]+)\)", index):
        assert (ROOT / "docs" / target).resolve().exists(), f"docs/README.md links {target}, which is missing"


def quoted_defaults() -> list[tuple[str, str, object]]:
    """(doc, phrase as written, the code's value the phrase must show)."""
    from ray_checkfreq.data.ray_data import RayDataOptions
    from ray_checkfreq.engine import CheckFreqConfig
    from ray_checkfreq.engine.adaptive import AdaptiveConfig
    from ray_checkfreq.engine.persist import PERSIST_NICE
    from ray_checkfreq.engine.policy import BEST_STORED_FRACTION, COMPRESSION_MARGIN, MIN_COMPRESSIBLE_BYTES
    from ray_checkfreq.engine.profiling import MEASURE_ITERS, MIN_TI_SAMPLES, WARMUP_ITERS
    from ray_checkfreq.ray.decisions import ACTION_INTS
    from ray_checkfreq.storage.store import StoreConfig

    store, adaptive = StoreConfig(), AdaptiveConfig()
    return [
        ("design.md", f"default {CheckFreqConfig().overhead}", 0.035),
        ("design.md", f"nice +{PERSIST_NICE}", 10),
        ("design.md", f"{WARMUP_ITERS} warm-up iterations, then {MIN_TI_SAMPLES} timed", (2, 5)),
        ("design.md", f"beside at least {MEASURE_ITERS} training iterations", 4),
        ("design.md", f"`max({adaptive.window_iters}, {adaptive.min_checkpoints_per_window}k)`", (50, 3)),
        ("design.md", f"`{adaptive.raise_to} p`", 0.8),
        ("design.md", f"`{adaptive.lower_to} p`", 0.7),
        ("design.md", f"`{adaptive.lower_below} p`", 0.5),
        ("design.md", f"{adaptive.pause_factor:g}x the window's median", 10),
        ("design.md", f"at least {adaptive.min_quiet_iters} of them", 5),
        ("design.md", f"at least\n  {MIN_COMPRESSIBLE_BYTES >> 20} MiB", 1),
        ("design.md", f"({BEST_STORED_FRACTION * 100:.0f} % of the bytes)", 66),
        ("design.md", f"at most {COMPRESSION_MARGIN}x the raw one", 0.8),
        ("format.md", f"`keep_last` checkpoints (default {store.keep_last})", 2),
        ("format.md", f"`full_every={store.full_every}`", 8),
        ("format.md", f"about {store.shard_size_bytes >> 20} MiB", 64),
        ("data.md", f"(default {RayDataOptions().chunk_rows})", 256),
        ("data.md", f"(default {RayDataOptions().window_chunks})", 64),
        ("ray.md", f"`dist.broadcast(int64[{ACTION_INTS}], src=0", 5),
    ]


def test_the_defaults_the_docs_quote_are_the_codes() -> None:
    wrong = [(doc, phrase) for doc, phrase, _ in quoted_defaults()
             if phrase not in (ROOT / "docs" / doc).read_text()]
    assert wrong == [], "docs quote defaults the code does not have (or the wording moved): " + repr(wrong)


def test_the_default_check_would_see_a_changed_default() -> None:
    changed = [(doc, phrase.replace("8", "9")) for doc, phrase, _ in quoted_defaults() if "full_every=8" in phrase]
    assert changed and all(phrase not in (ROOT / "docs" / doc).read_text() for doc, phrase in changed)


def test_the_configuration_reference_is_the_dataclasses_rendered() -> None:
    from tools import config_reference

    text = config_reference.DOC.read_text()
    assert text == config_reference.updated(text), (
        "docs/configuration.md's reference is out of date with the config dataclasses: "
        "run `python -m tools.config_reference --write`")


def test_the_reference_check_sees_a_stale_default_and_a_field_without_doc() -> None:
    import dataclasses

    from tools import config_reference

    text = config_reference.DOC.read_text()
    row = "| `keep_last` | `int` | `2` |"
    stale = text.replace(row, row.replace("`2`", "`3`"))
    assert row in text and stale != text and config_reference.updated(stale) == text

    @dataclasses.dataclass(kw_only=True)
    class Undocumented:
        documented: int = 1
        """A field with its doc."""
        bare: int = 2

    with pytest.raises(ValueError, match=r"bare"):
        config_reference.table(Undocumented, "nowhere")


def test_the_reference_names_where_users_import_each_class() -> None:
    import importlib

    from tools import config_reference

    for cls, where in config_reference.CLASSES:
        module, _, name = where.rpartition(".")
        assert getattr(importlib.import_module(module), name) is cls, where
