"""The UpdateWeights data messages the client writes and the server reads without protobuf
objects are byte for byte the protobuf encoding."""

from __future__ import annotations

import pytest

from sciproto.pb import policy_pb2
from sciproto.weights.wire import data_message_wire, parse_request


@pytest.mark.parametrize("size", [0, 1, 127, 128, 16_383, 16_384, 300_000])
def test_data_messages_on_the_wire_are_protobuf_encoded(size: int) -> None:
    payload = bytes(range(256)) * (size // 256) + bytes(size % 256)
    parts = [memoryview(payload)[: size // 3], memoryview(payload)[size // 3 :]]
    wire = data_message_wire(parts)
    assert wire == policy_pb2.UpdateWeightsRequest(data=payload).SerializeToString()
    parsed = parse_request(wire)
    assert isinstance(parsed, memoryview) and bytes(parsed) == payload
    header = policy_pb2.UpdateWeightsRequest(header=policy_pb2.WeightsHeader(policy_version=size))
    assert parse_request(header.SerializeToString()) == header
