"""Hypothesis strategies that build any protobuf message from its descriptor, with hints that
steer chosen fields towards values a server has to look at closely (known names, indices at the
edges of a split, live episode ids), and mutations of serialized messages on the wire.

    requests = message_strategy(env_pb2.StepRequest, hints={"sciproto.v1.StepRequest.episode_id": ids})
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from google.protobuf import descriptor as pb_descriptor
from google.protobuf.message import Message
from hypothesis import strategies as st

FD = pb_descriptor.FieldDescriptor

# Strings a parser or a template engine may trip on.
SPECIAL_TEXTS = [
    "", " ", "\x00", "\n", "null", "{}", "[]", "-1", "NaN", "💥" * 8, "\u202e\ufeff", "%s%n",
    "{{ raise_exception('x') }}", "<|im_end|>", "../../etc/passwd", "a" * 300,
]
INT_EDGES = [0, 1, -1, 2**31 - 1, -(2**31), 2**32 - 1, 2**63 - 1, -(2**63)]
UINT_EDGES = [0, 1, 2, 63, 64, 255, 256, 511, 512, 2**31 - 1, 2**32 - 1]

# Most string fields get short texts; one draw in HUGE_ONE_IN gets a large one.
HUGE_ONE_IN = 40
HUGE_SIZES = [70_000, 1_000_000]

Hints = Mapping[str, st.SearchStrategy[Any]]


def texts() -> st.SearchStrategy[str]:
    return st.integers(0, HUGE_ONE_IN - 1).flatmap(
        lambda pick: st.sampled_from(HUGE_SIZES).map(lambda size: "x" * size) if pick == 0
        else st.one_of(st.text(max_size=40), st.sampled_from(SPECIAL_TEXTS)))


def _ranged(low: int, high: int, edges: Sequence[int]) -> st.SearchStrategy[int]:
    return st.one_of(st.sampled_from([e for e in edges if low <= e <= high]), st.integers(low, high))


_SCALARS: dict[int, Callable[[], st.SearchStrategy[Any]]] = {
    FD.TYPE_STRING: texts,
    FD.TYPE_BYTES: lambda: st.binary(max_size=64),
    FD.TYPE_BOOL: st.booleans,
    FD.TYPE_DOUBLE: lambda: st.floats(allow_nan=True, allow_infinity=True),
    FD.TYPE_FLOAT: lambda: st.floats(allow_nan=True, allow_infinity=True, width=32),
    FD.TYPE_INT32: lambda: _ranged(-(2**31), 2**31 - 1, INT_EDGES),
    FD.TYPE_SINT32: lambda: _ranged(-(2**31), 2**31 - 1, INT_EDGES),
    FD.TYPE_INT64: lambda: _ranged(-(2**63), 2**63 - 1, INT_EDGES),
    FD.TYPE_SINT64: lambda: _ranged(-(2**63), 2**63 - 1, INT_EDGES),
    FD.TYPE_UINT32: lambda: _ranged(0, 2**32 - 1, UINT_EDGES),
    FD.TYPE_UINT64: lambda: _ranged(0, 2**64 - 1, UINT_EDGES),
    # Open enums take any int32: unknown numbers are part of the fuzz.
    FD.TYPE_ENUM: lambda: st.one_of(st.integers(-2, 9), st.sampled_from([2**31 - 1, -(2**31)])),
}


def message_strategy(cls: type[Message], hints: Hints | None = None, depth: int = 4) -> st.SearchStrategy[Message]:
    """Messages of type `cls` with any subset of fields set (at most one per oneof); `hints`
    maps a field's full name (e.g. "sciproto.v1.ResetRequest.env") to the strategy of its value
    (of one element, for repeated fields), and such fields are always set."""
    return _message(cls.DESCRIPTOR, dict(hints or {}), depth).map(lambda fields: _build(cls, fields))


def _build(cls: type[Message], fields: dict[str, Any]) -> Message:
    message = cls()
    _fill(message, fields)
    return message


def _fill(message: Message, fields: dict[str, Any]) -> None:
    for name, value in fields.items():
        field = message.DESCRIPTOR.fields_by_name[name]
        if _is_map(field):
            target = getattr(message, name)
            for key, item in value.items():
                if field.message_type.fields_by_name["value"].type == FD.TYPE_MESSAGE:
                    _fill(target[key], item)
                else:
                    target[key] = item
        elif field.is_repeated:
            target = getattr(message, name)
            for item in value:
                if field.type == FD.TYPE_MESSAGE:
                    _fill(target.add(), item)
                else:
                    target.append(item)
        elif field.type == FD.TYPE_MESSAGE:
            _fill(getattr(message, name), value)
            getattr(message, name).SetInParent()
        else:
            setattr(message, name, value)


def _is_map(field: pb_descriptor.FieldDescriptor) -> bool:
    return field.type == FD.TYPE_MESSAGE and field.message_type.GetOptions().map_entry


def _value(field: pb_descriptor.FieldDescriptor, hints: dict[str, st.SearchStrategy[Any]],
           depth: int) -> st.SearchStrategy[Any]:
    """The strategy of one value of `field` (fields as dicts for message values)."""
    if field.full_name in hints:
        return hints[field.full_name]
    if field.type == FD.TYPE_MESSAGE:
        if depth <= 0:
            return st.just({})
        return _message(field.message_type, hints, depth - 1)
    return _SCALARS[field.type]()


def _message(descriptor: pb_descriptor.Descriptor, hints: dict[str, st.SearchStrategy[Any]],
             depth: int) -> st.SearchStrategy[dict[str, Any]]:
    @st.composite
    def draw_fields(draw: st.DrawFn) -> dict[str, Any]:
        chosen_oneofs = {oneof.name: draw(st.sampled_from([None, *oneof.fields]))
                         for oneof in descriptor.oneofs if not oneof.name.startswith("_")}
        fields: dict[str, Any] = {}
        for field in descriptor.fields:
            oneof = field.containing_oneof
            if oneof is not None and not oneof.name.startswith("_"):
                if chosen_oneofs[oneof.name] is not field:
                    continue
            elif field.full_name not in hints and not draw(st.booleans()):
                continue  # a hinted field is always set: the hint is what the fuzz is steered by
            if _is_map(field):
                key = _value(field.message_type.fields_by_name["key"], hints, depth)
                fields[field.name] = draw(st.dictionaries(key, _value(field.message_type.fields_by_name["value"],
                                                                       hints, depth), max_size=3))
            elif field.is_repeated:
                fields[field.name] = draw(st.lists(_value(field, hints, depth), max_size=4))
            else:
                fields[field.name] = draw(_value(field, hints, depth))
        return fields

    return draw_fields()


def tool_arguments() -> st.SearchStrategy[str]:
    """Tool-call arguments as the policy may write them: JSON objects right and wrong, broken
    JSON, and expressions a calculator must not spend minutes on."""
    broken = st.sampled_from([
        "{", "}", "[]", "null", "1", '"text"', '{"expr": }', "{'expr': '1'}", '{"expr": "1"',
        '{"expr": "9**9**9"}', '{"expr": "round(5, -999999999)"}', '{"expr": "' + "(" * 500 + '"}',
        '{"expr": "1/0"}', '{"expr": "' + "1+" * 5000 + '1"}', '{"answer": null}', '{"answer": [1, 2]}',
        '{"expr": "__import__(\\"os\\").system(\\"true\\")"}', '{"a": {"b": {"c": {}}}}',
    ])
    objects = st.dictionaries(st.sampled_from(["expr", "answer", "contents", "x"]),
                              st.one_of(st.text(max_size=20), st.integers(), st.floats(), st.none()),
                              max_size=3).map(lambda d: json.dumps(d, allow_nan=True))
    return st.one_of(broken, objects, st.text(max_size=30))


def mutations(valid: Sequence[bytes]) -> st.SearchStrategy[bytes]:
    """Wire bytes: valid messages flipped, cut, padded, spliced, and strings with invalid UTF-8."""
    base = st.sampled_from(list(valid))

    @st.composite
    def mutate(draw: st.DrawFn) -> bytes:
        wire = bytearray(draw(base))
        kind = draw(st.sampled_from(["flip", "truncate", "append", "splice", "bad_utf8", "random"]))
        if kind == "flip" and wire:
            for _ in range(draw(st.integers(1, 4))):
                position = draw(st.integers(0, len(wire) - 1))
                wire[position] ^= 1 << draw(st.integers(0, 7))
        elif kind == "truncate" and wire:
            wire = wire[: draw(st.integers(0, len(wire) - 1))]
        elif kind == "append":
            wire += draw(st.binary(min_size=1, max_size=16))
        elif kind == "splice":
            wire += draw(base)
        elif kind == "bad_utf8":
            # a length-delimited field (numbers 1..15) holding bytes that are not UTF-8
            payload = draw(st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80",
                                            b"ok\x80"]))
            wire += bytes([(draw(st.integers(1, 15)) << 3) | 2, len(payload)]) + payload
        else:
            wire = bytearray(draw(st.binary(max_size=64)))
        return bytes(wire)

    return mutate()
