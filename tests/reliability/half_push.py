"""A weight push that stops halfway and waits to be killed: sends the header and half the data
chunks of the tiny model's weights as `version`, prints HALF, then sleeps.

    python tests/reliability/half_push.py HOST:PORT VERSION
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator

import grpc

from sciproto.client.policy import distinct_tensors
from sciproto.models import load_model
from sciproto.pb import policy_pb2
from sciproto.weights.wire import (
    chunk_parts,
    data_message_wire,
    header_for,
    serialize_request,
)

CHUNK_BYTES = 16 * 1024


def half_update(version: int) -> Iterator[policy_pb2.UpdateWeightsRequest | bytes]:
    weights = distinct_tensors(load_model("tiny", seed=0).model.state_dict())
    chunks = [data_message_wire(parts) for parts in chunk_parts(weights, CHUNK_BYTES)]
    yield policy_pb2.UpdateWeightsRequest(header=header_for(weights, version))
    yield from chunks[: len(chunks) // 2]
    print("HALF", flush=True)  # gRPC asks for the next message once the previous ones are sent
    time.sleep(3600)


def main() -> None:
    target, version = sys.argv[1], int(sys.argv[2])
    with grpc.insecure_channel(target) as channel:
        send = channel.stream_unary("/sciproto.v1.PolicyService/UpdateWeights", request_serializer=serialize_request,
                                    response_deserializer=policy_pb2.UpdateWeightsResponse.FromString)
        send(half_update(version), timeout=3600)


if __name__ == "__main__":
    main()
