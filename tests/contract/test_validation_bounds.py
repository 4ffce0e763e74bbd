"""What a contract field holds, read from its protobuf type (`libs/contract/bounds.py`), and
`SamplingParams` built from plain values refused as the router refuses them
(`validation.sampling_params`): the one check the HTTP door and the router share."""

from __future__ import annotations

from typing import Any

import pytest
from google.protobuf.descriptor import Descriptor, FieldDescriptor

from libs.contract.bounds import check_fields, checked, describe, int_range, lone_surrogate
from libs.contract.epd.v1 import (
    chat_pb2,
    decode_pb2,
    encoder_pb2,
    generate_pb2,
    layout_pb2,
    prefill_pb2,
    sampling_pb2,
    tensor_pb2,
)
from libs.contract.errors import InvalidArgument
from libs.contract.validation import DEFAULT_LIMITS, Limits, sampling_params, validate_sampling

pytestmark = pytest.mark.unit

_SAMPLING = sampling_pb2.SamplingParams.DESCRIPTOR


def _messages(descriptor: Descriptor, seen: set[str]) -> list[Descriptor]:
    if descriptor.full_name in seen:
        return []
    seen.add(descriptor.full_name)
    found = [descriptor]
    for field in descriptor.fields:
        if field.message_type is not None:
            found += _messages(field.message_type, seen)
    return found


_REQUESTS = [
    generate_pb2.GenerateRequest,
    encoder_pb2.EncodeRequest,
    prefill_pb2.PrefillRequest,
    decode_pb2.DecodeRequest,
    layout_pb2.ItemLayout,
    tensor_pb2.TensorHandle,
]


def test_every_integer_field_of_the_contract_has_its_widths_range() -> None:
    """Each integer field's range is its type's, and protobuf itself takes the ends and refuses one
    past them: the table is the wire's, not a guess."""
    seen: set[str] = set()
    checked_fields = 0
    for request in _REQUESTS:
        for message in _messages(request.DESCRIPTOR, seen):
            for field in message.fields:
                if (
                    field.type
                    not in (
                        FieldDescriptor.TYPE_INT32,
                        FieldDescriptor.TYPE_INT64,
                        FieldDescriptor.TYPE_UINT32,
                        FieldDescriptor.TYPE_UINT64,
                    )
                    or field.containing_oneof is not None
                ):
                    continue
                low, high = int_range(field)
                cls: Any = message._concrete_class
                for fine in (low, high):
                    value = [fine] if field.is_repeated else fine
                    cls(**{field.name: value})
                    check_fields(message, {field.name: value}, "m")
                for past in (low - 1, high + 1):
                    value = [past] if field.is_repeated else past
                    with pytest.raises(ValueError):
                        cls(**{field.name: value})
                    with pytest.raises(InvalidArgument):
                        check_fields(message, {field.name: value}, "m")
                checked_fields += 1
    assert checked_fields >= 20


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("max_tokens", (-(2**31), 2**31 - 1)),  # int32
        ("seed", (0, 2**64 - 1)),  # uint64
        ("stop_token_ids", (-(2**31), 2**31 - 1)),  # repeated int32
    ],
)
def test_ranges_by_type(name: str, expected: tuple[int, int]) -> None:
    assert int_range(_SAMPLING.fields_by_name[name]) == expected


def test_a_field_that_holds_no_integer_has_no_range() -> None:
    with pytest.raises(ValueError):
        int_range(_SAMPLING.fields_by_name["temperature"])


@pytest.mark.parametrize(
    ("values", "field", "problem"),
    [
        ({"max_tokens": 2**31}, "s.max_tokens", "outside the int32 field's range"),
        ({"top_k": -(2**31) - 1}, "s.top_k", "outside the int32 field's range"),
        ({"seed": -1}, "s.seed", "outside the uint64 field's range"),
        ({"seed": 2**64}, "s.seed", "outside the uint64 field's range"),
        ({"stop_token_ids": [1, 2**40]}, "s.stop_token_ids[1]", "1099511627776 is outside"),
        ({"max_tokens": 10**30}, "s.max_tokens", "an integer of 100 bits"),
        ({"max_tokens": True}, "s.max_tokens", "must be an integer, got bool"),
        ({"max_tokens": 2.0}, "s.max_tokens", "must be an integer, got float"),
        ({"ignore_eos": 1}, "s.ignore_eos", "must be a boolean"),
        ({"temperature": "1"}, "s.temperature", "must be a number"),
        ({"temperature": True}, "s.temperature", "must be a number"),
        ({"repetition_penalty": 1e39}, "s.repetition_penalty", "beyond the float field's range"),
        ({"repetition_penalty": 10**400}, "s.repetition_penalty", "beyond a floating-point field"),
        ({"stop": ["ok", "a\ud800"]}, "s.stop[1]", "lone surrogate at character 1"),
        ({"stop": [3]}, "s.stop[0]", "must be a string"),
    ],
)
def test_a_value_its_field_cannot_hold_is_refused_by_path(values: dict[str, Any], field: str, problem: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        checked(sampling_pb2.SamplingParams, "s", **values)
    assert caught.value.field == field and problem in caught.value.problem, caught.value


def test_checked_builds_what_fits_and_passes_messages_through() -> None:
    params = checked(sampling_pb2.SamplingParams, "s", max_tokens=2**31 - 1, seed=2**64 - 1, temperature=3.4e38)
    assert (params.max_tokens, params.seed) == (2**31 - 1, 2**64 - 1)
    request = checked(generate_pb2.GenerateRequest, "", request_id="r", sampling=params)
    assert request.sampling.seed == 2**64 - 1
    with pytest.raises(InvalidArgument) as caught:
        checked(chat_pb2.ContentPart, "messages[0].content", text="hi \udfff")
    assert caught.value.field == "messages[0].content.text"


def test_describe_and_surrogates() -> None:
    assert describe(2**64 - 1) == str(2**64 - 1)
    assert describe(10**5000) == "an integer of 16610 bits"  # never str() of it (Python refuses)
    assert lone_surrogate("plain") is None and lone_surrogate("emoji \U0001f600") is None
    assert lone_surrogate("ab\udc00") == 2


def test_sampling_params_are_the_routers_checks_after_the_widths() -> None:
    limits = Limits(max_tokens=64)
    assert sampling_params({"max_tokens": 64, "min_tokens": 64}, "sampling", limits).max_tokens == 64
    for values, field in (
        ({"max_tokens": 65}, "sampling.max_tokens"),  # the model's limit: validate_sampling's
        ({"max_tokens": 2**31}, "sampling.max_tokens"),  # the width: before protobuf sees it
        ({"max_tokens": 8, "min_tokens": 9}, "sampling.min_tokens"),
        ({"stop": ["a", ""]}, "sampling.stop[1]"),
        ({"logprobs": DEFAULT_LIMITS.max_logprobs + 1}, "sampling.logprobs"),
    ):
        with pytest.raises(InvalidArgument) as caught:
            sampling_params(values, "sampling", limits)
        assert caught.value.field == field, (values, caught.value)
        # What sampling_params refuses past the widths, the router refuses on the same message.
        if field != "sampling.max_tokens" or values["max_tokens"] < 2**31:
            with pytest.raises(InvalidArgument):
                validate_sampling(sampling_pb2.SamplingParams(**values), "sampling", limits)
