"""LocalStore and MemoryStore agree on every random sequence of operations (same results, same errors)."""

from __future__ import annotations

import tempfile
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from deltarl.storage import LocalStore, MemoryStore
from deltarl.storage.keys import etag_of
from deltarl.storage.store import ObjectStore

KEYS = st.sampled_from(["a", "b", "d/x", "d/y", "e/f/g"])
VALUES = st.sampled_from([b"", b"0", b"1", b"hello world"])
ETAGS = st.one_of(st.none(), VALUES.map(etag_of))
OFFSETS = st.integers(min_value=-1, max_value=14)

OPS = st.one_of(
    st.tuples(st.just("put"), KEYS, VALUES),
    st.tuples(st.just("put_if_absent"), KEYS, VALUES),
    st.tuples(st.just("cas"), KEYS, VALUES, ETAGS),
    st.tuples(st.just("get"), KEYS),
    st.tuples(st.just("get_range"), KEYS, OFFSETS, st.one_of(st.none(), OFFSETS)),
    st.tuples(st.just("head"), KEYS),
    st.tuples(st.just("exists"), KEYS),
    st.tuples(st.just("delete"), KEYS),
    st.tuples(st.just("list"), st.sampled_from(["", "d", "d/", "e/f/", "z"])),
)


def apply(store: ObjectStore, op: tuple[Any, ...]) -> object:
    name, *args = op
    try:
        result = getattr(store, name)(*args)
    except Exception as err:
        return type(err)
    return list(result) if name == "list" else result


@settings(max_examples=150, deadline=None)
@given(st.lists(OPS, max_size=25))
def test_local_matches_memory(ops: list[tuple[Any, ...]]) -> None:
    memory = MemoryStore()
    with tempfile.TemporaryDirectory() as root:
        local = LocalStore(root, fsync=False)
        for op in ops:
            assert apply(local, op) == apply(memory, op), op
