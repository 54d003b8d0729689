"""The typed JSON of non-tensor values: exact round trips, and a decoder that only refuses hostile input."""
import collections
import math
import struct
import time
import tracemalloc

import pytest
from hypothesis import given, settings, strategies as st

from alpha_ckpt import Refusal, RefusalCode
from alpha_ckpt.format.records import canonical_json, parse_canonical_json
from alpha_ckpt.format.values import decode_value, encode_value
from gpt_training import assert_identical

KEYS = st.text(max_size=8) | st.integers(-2**70, 2**70)
VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=30)
    | st.binary(max_size=30) | st.integers(-2**200, 2**200),
    lambda children: st.lists(children, max_size=4) | st.lists(children, max_size=4).map(tuple)
    | st.dictionaries(KEYS, children, max_size=4)
    | st.dictionaries(KEYS, children, max_size=4).map(collections.OrderedDict)
    | st.dictionaries(KEYS, st.integers(), max_size=4).map(collections.Counter),
    max_leaves=20)


def _round_trip(value):
    return decode_value(parse_canonical_json(canonical_json(encode_value(value)), "value"))


@settings(max_examples=300, deadline=None)
@given(VALUES)
def test_every_value_comes_back_with_its_type_and_bits(value):
    assert_identical(_round_trip(value), value)


def test_floats_keep_nan_payloads_infinities_and_negative_zero():
    payload_nan = struct.unpack(">d", bytes.fromhex("7ff8000000000123"))[0]
    for f in (payload_nan, -math.nan, math.inf, -math.inf, -0.0, 5e-324, 1.0):
        assert struct.pack(">d", _round_trip(f)) == struct.pack(">d", f)
    assert type(_round_trip(1.0)) is float and type(_round_trip(1)) is int and type(_round_trip(True)) is bool


def test_what_a_state_cannot_hold_is_named():
    with pytest.raises(ValueError, match="optim.extra"):
        encode_value({"extra": {1, 2}}, "optim")
    with pytest.raises(ValueError, match="key"):
        encode_value({(1, 2): 3}, "x")


def _decode(text: str):
    return decode_value(parse_canonical_json(text.encode(), "hostile"), "hostile")


@pytest.mark.parametrize("text", [
    '{"float":"3FF0000000000000"}', '{"float":"3ff"}', '{"float":1.0}', '1.5', '{"bigint":"1"}', '{"bigint":"01f"}',
    '{"bigint":"-"}', '{"bigint":"xyz"}', '{"bytes":"a"}', '{"bytes":"YQ"}', '{"tuple":1}', '{"dict":[[1]]}',
    '{"dict":[[1.5,2]]}', '{"dict":[[1,2],[1,3]]}', '{"counter":[[[1],2]]}', '{"pickle":"gASV"}', '{"a":1,"b":2}',
    '{}', '{"tensor":""}', '{"dict":[[{"tuple":[]},1]]}', '99999999999999999999',
])
def test_malformed_typed_values_are_refused_as_format(text):
    with pytest.raises(Refusal) as info:
        _decode(text)
    assert info.value.code == RefusalCode.FORMAT


@pytest.mark.timeout(60)
@pytest.mark.parametrize("make", [
    lambda: "[" * 200_000 + "]" * 200_000,                       # nesting deeper than any parser's stack
    lambda: '{"tuple":' * 100 + "[]" + "}" * 100,               # deeper than MAX_DEPTH, parsed fine
    lambda: '{"bigint":"' + "f" * 2_000_000 + '"}',             # a 2M-digit integer: refused before int()
    lambda: "1" * 100_000,                                       # a 100k-digit decimal
    lambda: '"' + "x" * 20_000_000 + '"',                        # a 20 MB string: decoded, costs its own size
])
def test_hostile_inputs_cost_bounded_time_and_memory(make):
    text = make()
    tracemalloc.start()
    started = time.monotonic()
    try:
        _decode(text)
    except Refusal as refusal:
        assert refusal.code == RefusalCode.FORMAT
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert time.monotonic() - started < 20
    assert peak < 8 * len(text) + (1 << 20)
