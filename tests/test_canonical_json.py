"""The manifests' fast encoder writes exactly what ``json.dumps(indent=1)`` writes: a stored
manifest is accepted only if it is this encoding of what it parses to."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ray_checkfreq.storage.canonical_json import dumps_indented

SCALARS = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text()
KEYS = st.text() | st.integers() | st.booleans() | st.none() | st.floats(allow_nan=False, allow_infinity=False)
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=5) | st.dictionaries(KEYS, inner, max_size=5),
                      max_leaves=40)


@settings(max_examples=400, deadline=None)
@given(VALUES)
def test_the_bytes_are_json_dumps_indent_1(value):
    assert dumps_indented(value) == json.dumps(value, indent=1, allow_nan=False).encode("utf-8")


@pytest.mark.parametrize("bad", [float("nan"), [float("inf")], {"x": -float("inf")}])
def test_what_json_refuses_is_refused(bad):
    with pytest.raises(ValueError, match="Out of range float"):
        dumps_indented(bad)


@pytest.mark.parametrize("bad", [{1, 2}, {"x": b"bytes"}, {(1, 2): 3}])
def test_what_json_cannot_encode_is_a_type_error(bad):
    with pytest.raises(TypeError):
        dumps_indented(bad)
