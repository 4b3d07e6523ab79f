"""Type checks of user values and the blob packing of by-reference columns."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from flexmarl_jax.store.schema import ALLOWED_TYPES, ColumnSpec, TableSchema, parse_column_type
from flexmarl_jax.store.values import coerce_column, pack_blob, unpack_rows

INT32_SEQ = ColumnSpec("tokens", "int32[]", "data")
FLOAT_SEQ = ColumnSpec("logprobs", "float32[]", "data")
TEXT = ColumnSpec("note", "str", "data")


@given(st.lists(st.lists(st.integers(-(2**31), 2**31 - 1), max_size=20), min_size=1, max_size=20))
def test_int_sequences_round_trip_through_one_blob(rows):
    values = coerce_column(INT32_SEQ, rows, len(rows))
    data, refs = pack_blob(INT32_SEQ, values, blob_id=9)
    assert (refs[:, 0] == 9).all() and refs[:, 2].tolist() == [len(r) for r in rows]
    blob = np.frombuffer(data, "<i4")
    assert len(blob) == sum(map(len, rows))
    for got, want in zip(unpack_rows(INT32_SEQ, blob, refs), rows, strict=True):
        assert got.tolist() == want


@given(st.lists(st.text(max_size=12), min_size=1, max_size=20))
def test_strings_round_trip_through_one_blob(rows):
    data, refs = pack_blob(TEXT, coerce_column(TEXT, rows, len(rows)), blob_id=1)
    assert unpack_rows(TEXT, data, refs) == rows


@given(
    st.lists(
        st.lists(st.floats(allow_nan=False, width=32) | st.integers(-1000, 1000), max_size=8),
        min_size=1,
        max_size=8,
    )
)
def test_float_sequences_take_floats_and_ints(rows):
    values = coerce_column(FLOAT_SEQ, rows, len(rows))
    assert all(v.dtype == np.float32 for v in values)
    data, refs = pack_blob(FLOAT_SEQ, values, blob_id=1)
    for got, want in zip(unpack_rows(FLOAT_SEQ, np.frombuffer(data, "<f4"), refs), rows, strict=True):
        np.testing.assert_array_equal(got, np.asarray(want, np.float32))


@pytest.mark.parametrize(
    ("spec", "values", "message"),
    [
        (
            INT32_SEQ,
            [[1.5]],
            r"'tokens' is int32\[\]; got values of dtype float64 \(allowed dtype kinds: signed",
        ),
        (INT32_SEQ, [[True]], r"got values of dtype bool"),
        (INT32_SEQ, [[2**31]], r"values range \[2147483648, 2147483648\] does not fit"),
        (INT32_SEQ, [np.array([-1], np.int64), np.array([2**40])], r"does not fit"),
        (
            ColumnSpec("reward", "float32", "data"),
            ["a", "b"],
            r"'reward' is float32; got values of dtype <U1",
        ),
        (ColumnSpec("ok", "bool", "data"), [1, 0], r"'ok' is bool; got values of dtype int64"),
        (TEXT, ["a", 3], r"'note' is str; got a value of type int: 3"),
        (TEXT, "ab", r"needs a list of 2 str"),
    ],
)
def test_wrong_dtypes_raise_type_error_naming_column_and_allowed(spec, values, message):
    with pytest.raises(TypeError, match=message):
        coerce_column(spec, values, 2 if spec is TEXT else len(values))


def test_wrong_lengths_and_shapes_raise_value_error():
    with pytest.raises(ValueError, match=r"needs 3 values \(shape \[3\]\), got \(2,\)"):
        coerce_column(ColumnSpec("reward", "float32", "data"), [1.0, 2.0], 3)
    with pytest.raises(ValueError, match=r"holds 1-D sequences; got one of shape \(1, 2\)"):
        coerce_column(INT32_SEQ, [[[1, 2]]], 1)
    np.testing.assert_array_equal(coerce_column(ColumnSpec("r", "float32", "data"), 2, 3), [2.0, 2.0, 2.0])


def test_schema_names_and_types_are_checked():
    assert parse_column_type("x", np.float32) == "float32"
    assert set(ALLOWED_TYPES) >= {"int32", "float32[]", "str"}
    with pytest.raises(ValueError, match=r"extra column 'reward' clashes with a built-in column"):
        TableSchema.build(["a"], {"reward": "float32"})
    with pytest.raises(ValueError, match=r"extra column name 'a__b' is not allowed"):
        TableSchema.build(["a"], {"a__b": "float32"})
    with pytest.raises(ValueError, match=r"agent name 'a/b' is not allowed"):
        TableSchema.build(["a/b"], None)
    with pytest.raises(ValueError, match=r"duplicates"):
        TableSchema.build(["a", "a"], None)
    specs = {spec.name: spec for spec in TableSchema.build(["p", "s"], {"x": "int64[]"}).all_specs()}
    assert {"version__p", "version__s", "status__x", "status__reward", "sample_id"} <= set(specs)
    assert specs["x"].by_reference and not specs["reward"].by_reference
