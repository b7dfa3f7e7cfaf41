"""`sciproto describe HOST:PORT`: health, services and Describe of any sciproto server."""

from __future__ import annotations

import json
from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from sciproto import pb
from sciproto.channel import ChannelConfig, make_channel
from sciproto.errors import from_rpc_error

_DESCRIBERS = {
    pb.ENV_SERVICE: (pb.env_grpc.EnvironmentServiceStub, pb.env_pb2.EnvironmentServiceDescribeRequest),
    pb.POLICY_SERVICE: (pb.policy_grpc.PolicyServiceStub, pb.policy_pb2.PolicyServiceDescribeRequest),
    pb.LEARNER_SERVICE: (pb.learner_grpc.LearnerServiceStub, pb.learner_pb2.LearnerServiceDescribeRequest),
}


async def list_services(channel: grpc.aio.Channel, timeout_s: float) -> list[str]:
    """Service names from server reflection."""
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    async for response in stub.ServerReflectionInfo(iter([request]), timeout=timeout_s):
        return [s.name for s in response.list_services_response.service]
    return []


async def describe(config: ChannelConfig) -> dict[str, Any]:
    """Health status, reflected services and each sciproto service's Describe."""
    async with make_channel(config) as channel:
        timeout = config.default_timeout_s
        health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        result: dict[str, Any] = {
            "target": config.target,
            "health": health_pb2.HealthCheckResponse.ServingStatus.Name(health.status),
            "services": await list_services(channel, timeout),
        }
        for name in result["services"]:
            if name in _DESCRIBERS:
                stub_cls, request_cls = _DESCRIBERS[name]
                try:
                    response = await stub_cls(channel).Describe(request_cls(), timeout=timeout)
                    result[name] = MessageToDict(response, preserving_proto_field_name=True)
                except grpc.RpcError as error:
                    failure = from_rpc_error(error)
                    result[name] = {"error": failure.code.name, "reason": failure.reason, "message": failure.message}
        return result


def to_json(result: dict[str, Any]) -> str:
    return json.dumps(result, indent=2, sort_keys=False)
