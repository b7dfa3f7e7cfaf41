"""The generated protobuf and gRPC modules, under short stable names.

    from sciproto.pb import env_pb2, env_grpc
    env_pb2.ResetRequest(env="gsm8k", task_ref=env_pb2.TaskRef(split="test", index=0))
"""

from sciproto._proto.sciproto.v1 import common_pb2
from sciproto._proto.sciproto.v1 import environment_service_pb2 as env_pb2
from sciproto._proto.sciproto.v1 import environment_service_pb2_grpc as env_grpc
from sciproto._proto.sciproto.v1 import learner_service_pb2 as learner_pb2
from sciproto._proto.sciproto.v1 import learner_service_pb2_grpc as learner_grpc
from sciproto._proto.sciproto.v1 import policy_service_pb2 as policy_pb2
from sciproto._proto.sciproto.v1 import policy_service_pb2_grpc as policy_grpc

ENV_SERVICE = env_pb2.DESCRIPTOR.services_by_name["EnvironmentService"].full_name
POLICY_SERVICE = policy_pb2.DESCRIPTOR.services_by_name["PolicyService"].full_name
LEARNER_SERVICE = learner_pb2.DESCRIPTOR.services_by_name["LearnerService"].full_name

__all__ = [
    "ENV_SERVICE",
    "LEARNER_SERVICE",
    "POLICY_SERVICE",
    "common_pb2",
    "env_grpc",
    "env_pb2",
    "learner_grpc",
    "learner_pb2",
    "policy_grpc",
    "policy_pb2",
]
