"""The upload source that reads a list of buffers as one seekable file (no joining copy)."""

from hypothesis import given
from hypothesis import strategies as st

from ray_checkfreq.storage.backends.s3 import BufferWriter, ChunkReader


@given(chunks=st.lists(st.binary(max_size=20), max_size=6), data=st.data())
def test_any_seek_and_read_matches_the_joined_bytes(chunks, data):
    joined = b"".join(chunks)
    reader = ChunkReader(chunks)
    position = data.draw(st.integers(0, len(joined)))
    reader.seek(position)
    out = bytearray(data.draw(st.integers(1, 40)))
    n = reader.readinto(out)
    assert bytes(out[:n]) == joined[position:position + len(out)]
    assert reader.tell() == position + n


@given(payload=st.binary(min_size=1, max_size=64), cut=st.integers(0, 64))
def test_parts_written_out_of_order_land_in_place(payload, cut):
    cut = min(cut, len(payload))
    sink = BufferWriter(len(payload))
    sink.seek(cut)
    sink.write(payload[cut:])
    sink.seek(0)
    sink.write(payload[:cut])
    assert bytes(sink.buffer) == payload
