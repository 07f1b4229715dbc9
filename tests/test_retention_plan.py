"""``plan_retention`` is pure: its invariants checked over generated listings (hypothesis),
without storage. The store's own retention tests (test_store_local.py,
test_nearlossless_store.py) check that the store executes the plan."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from ray_checkfreq.storage.legacy import Manifest, ShardEntry
from ray_checkfreq.storage.manifest import MANIFEST_NAME
from ray_checkfreq.storage.retention import StoredEntry, plan_retention


def entry(i: int, *, generation: int, epoch: bool, intact: bool, trimmed_source: str | None = None,
          delta_base: str | None = None) -> StoredEntry:
    name = f"step-{i:012d}-g{generation:06d}-x"
    manifest = Manifest(step=i, epoch_boundary=epoch, created_unix_ns=i, shards=(ShardEntry(name="s0", size_bytes=10),),
                        tensors=(), state=None, delta_base=delta_base,
                        history_trim={"source": trimmed_source} if trimmed_source else None)
    files = {MANIFEST_NAME: 1, "s0": 10 if intact else 3}
    return StoredEntry(name=name, step=i, generation=generation, files=files, manifest=manifest)


@st.composite
def listings(draw):
    count = draw(st.integers(1, 12))
    entries = []
    for i in range(count):
        base = draw(st.sampled_from([None, *(e.name for e in entries if e.manifest.delta_base is None)]))
        entries.append(entry(i + 1, generation=draw(st.integers(1, 3)), epoch=draw(st.booleans()),
                             intact=draw(st.booleans()), delta_base=base))
    entries.sort(key=StoredEntry.order_key)
    return entries


@settings(max_examples=200, deadline=None)
@given(entries=listings(), keep_last=st.integers(1, 4), keep_epochs=st.booleans(), writer=st.integers(1, 3),
       protected=st.sets(st.integers(1, 12), max_size=3), trim=st.booleans())
def test_the_plan_keeps_what_the_invariants_name(entries, keep_last, keep_epochs, writer, protected, trim):
    just_saved = entries[-1].name
    plan = plan_retention(entries, keep_last=keep_last, keep_epoch_boundaries=keep_epochs, protected_steps=protected,
                          just_saved=just_saved, newest_verified=None, writer_generation=writer, trim=trim)
    deleted = set(plan.delete) | set(plan.rewrite) | set(plan.drop_copied)
    by_name = {e.name: e for e in entries}
    assert just_saved not in deleted
    assert not any(by_name[name].generation > writer for name in deleted), "a newer writer's checkpoint deleted"
    assert not any(by_name[name].step in protected for name in deleted), "a protected step deleted"
    intact_exact = [e for e in reversed(entries) if e.intact()][:keep_last]
    assert not deleted & {e.name for e in intact_exact}, "one of the newest keep_last intact checkpoints deleted"
    for name in plan.keep:  # a kept delta's base is kept
        base = by_name[name].manifest.delta_base if name in by_name else None
        assert base is None or base in plan.keep
    if keep_epochs and not trim:
        assert not any(by_name[n].manifest.epoch_boundary and by_name[n].intact() for n in plan.delete)
    assert len(plan.rewrite) <= 1 and (trim or not plan.rewrite)


def test_history_trimming_plans_one_rewrite_and_drops_sources_already_copied():
    old_a = entry(1, generation=1, epoch=True, intact=True)
    old_b = entry(2, generation=1, epoch=True, intact=True)
    old_c = entry(3, generation=1, epoch=True, intact=True)
    copy_b = entry(4, generation=1, epoch=True, intact=True, trimmed_source=old_b.name)
    recent = [entry(i, generation=1, epoch=False, intact=True) for i in (5, 6)]
    entries = [old_a, old_b, old_c, copy_b, *recent]
    plan = plan_retention(entries, keep_last=2, keep_epoch_boundaries=True, protected_steps=set(),
                          just_saved=recent[-1].name, newest_verified=None, writer_generation=1, trim=True)
    assert plan.delete == ()
    assert plan.rewrite == (old_a.name,) and plan.drop_copied == (old_b.name,)


def test_a_delta_base_in_use_is_neither_deleted_nor_trimmed():
    base = entry(1, generation=1, epoch=True, intact=True)
    recent = [entry(2, generation=1, epoch=False, intact=True, delta_base=base.name),
              entry(3, generation=1, epoch=False, intact=True, delta_base=base.name)]
    plan = plan_retention([base, *recent], keep_last=2, keep_epoch_boundaries=False, protected_steps=set(),
                          just_saved=recent[-1].name, newest_verified=None, writer_generation=1, trim=True,
                          delta_base_in_use=base.name)
    assert base.name in plan.keep and not plan.delete and not plan.rewrite
