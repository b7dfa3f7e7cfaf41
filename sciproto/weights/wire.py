"""Weights as an UpdateWeights stream: a header (manifest) then raw little-endian bytes of every
tensor, concatenated in manifest order and cut into chunks.

Both ends live here: `header_for`, `chunk_parts` and `data_message_wire` on the sending side (no
copy of the whole model is ever made: each chunk is copied once out of its tensors, straight into
its wire message), `parse_request`, `check_header` and `WeightsReceiver` on the receiving side
(a chunk is read as a view of the received message and copied once, into preallocated tensors).
"""

from __future__ import annotations

import hashlib
import math
import sys
from collections.abc import Iterator, Mapping, Sequence

import torch
import xxhash

from sciproto.errors import FailedPrecondition, InvalidArgument, Reason
from sciproto.pb import policy_pb2
from sciproto.units import MiB
from sciproto.weights.tensors import TensorSpec, dtype_name

DTYPE_TO_PROTO: dict[str, int] = {
    "float32": policy_pb2.TENSOR_DTYPE_FLOAT32,
    "bfloat16": policy_pb2.TENSOR_DTYPE_BFLOAT16,
    "float16": policy_pb2.TENSOR_DTYPE_FLOAT16,
    "float8_e4m3fn": policy_pb2.TENSOR_DTYPE_FLOAT8_E4M3FN,
    "int64": policy_pb2.TENSOR_DTYPE_INT64,
}
PROTO_TO_DTYPE = {number: name for name, number in DTYPE_TO_PROTO.items()}

if sys.byteorder != "little":  # the wire format is little-endian and tensors are sent as they lie
    raise ImportError("weight streaming needs a little-endian host")


def spec_nbytes(spec: TensorSpec) -> int:
    return math.prod(spec.shape) * torch.empty((), dtype=getattr(torch, spec.dtype)).element_size()


def dtype_to_proto(dtype: str) -> int:
    if dtype not in DTYPE_TO_PROTO:
        raise ValueError(f"dtype {dtype} cannot travel in a weight update; use one of {sorted(DTYPE_TO_PROTO)}")
    return DTYPE_TO_PROTO[dtype]


# -- sending ------------------------------------------------------------------------------------


def header_for(tensors: Mapping[str, torch.Tensor], version: int, request_id: str = "",
               digests: Sequence[bytes] | None = None) -> policy_pb2.WeightsHeader:
    """The header of an update of `tensors`; with `digests` (`tensor_digests` of the same
    tensors), every TensorSpec carries its digest and the provenance the set's."""
    specs = [policy_pb2.TensorSpec(name=name, shape=list(t.shape), dtype=dtype_to_proto(dtype_name(t.dtype)))
             for name, t in tensors.items()]
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    header = policy_pb2.WeightsHeader(request_id=request_id, policy_version=version, tensors=specs,
                                      total_bytes=total, transport=policy_pb2.WEIGHT_TRANSPORT_GRPC_CHUNKS)
    if digests is not None:
        if len(digests) != len(specs):
            raise ValueError(f"{len(digests)} digests for {len(specs)} tensors")
        for spec, digest in zip(header.tensors, digests):
            spec.digest = digest
        header.provenance.set_digest = set_digest(digests)
    return header


def weights_sha256(tensors: Mapping[str, torch.Tensor]) -> bytes:
    """WeightsProvenance.sha256 of an update of `tensors`: the SHA-256 of their bytes in order
    (pass the same mapping, after `distinct_tensors`, that is sent)."""
    digest = hashlib.sha256()
    for tensor in tensors.values():
        digest.update(_byte_view(tensor))
    return digest.digest()


def tensor_digests(tensors: Mapping[str, torch.Tensor]) -> list[bytes]:
    """TensorSpec.digest of each tensor, in order: the XXH3-128 of its bytes as they travel
    (16 bytes, xxhash's canonical big-endian form). XXH3 hashes SmolLM2's tensors 7 times as
    fast as SHA-256 on this project's CPU (bench/weight_digests.py), so checking every update
    costs a push little; it detects corruption and wrong tensors, not tampering (auth and TLS
    do that)."""
    return [xxhash.xxh3_128_digest(_byte_view(tensor)) for tensor in tensors.values()]


def set_digest(digests: Sequence[bytes]) -> bytes:
    """WeightsProvenance.set_digest: the XXH3-128 of the tensor digests concatenated in order."""
    return xxhash.xxh3_128_digest(b"".join(digests))


def _byte_view(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes on the CPU, without a copy when it already is contiguous there."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


def chunk_parts(tensors: Mapping[str, torch.Tensor], chunk_bytes: int = 4 * MiB) -> Iterator[list[memoryview]]:
    """The tensors' bytes in order, cut into chunks of exactly `chunk_bytes` (the last may be
    shorter); each chunk is the list of tensor slices it is made of, nothing copied yet. Small
    tensors share a chunk, so a model with many norms still travels in few messages."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    parts: list[memoryview] = []
    size = 0
    for tensor in tensors.values():
        view = _byte_view(tensor)
        position = 0
        while position < len(view):
            take = min(chunk_bytes - size, len(view) - position)
            parts.append(view[position : position + take])
            position += take
            size += take
            if size == chunk_bytes:
                yield parts
                parts, size = [], 0
    if parts:
        yield parts


# UpdateWeightsRequest.data is field 2, length-delimited: tag byte (2 << 3) | 2.
_DATA_TAG = 0x12


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def data_message_wire(parts: list[memoryview]) -> bytes:
    """The serialized UpdateWeightsRequest{data = parts joined}, built with a single copy out of
    the tensors (going through the protobuf object would copy the bytes three times)."""
    return b"".join([bytes([_DATA_TAG]), _varint(sum(len(part) for part in parts)), *parts])


def serialize_request(message: policy_pb2.UpdateWeightsRequest | bytes) -> bytes:
    """Client-side serializer of UpdateWeights: messages, or data messages already on the wire."""
    return message if isinstance(message, bytes) else message.SerializeToString()


def parse_request(wire: bytes) -> policy_pb2.UpdateWeightsRequest | memoryview:
    """Server-side deserializer of UpdateWeights: a data-only message becomes a view of its
    payload inside the received bytes (no copy); anything else is parsed as protobuf."""
    if len(wire) > 1 and wire[0] == _DATA_TAG:
        length, shift, position = 0, 0, 1
        while position < len(wire) and position <= 10:
            byte = wire[position]
            length |= (byte & 0x7F) << shift
            position += 1
            if not byte & 0x80:
                if position + length == len(wire):
                    return memoryview(wire)[position:]
                break
            shift += 7
    return policy_pb2.UpdateWeightsRequest.FromString(wire)


# -- receiving ----------------------------------------------------------------------------------


def check_header(header: policy_pb2.WeightsHeader, manifest: Sequence[TensorSpec],
                 current_version: int) -> list[TensorSpec]:
    """The header's tensors as specs, in stream order, after checking them against the model's
    manifest; raises the error the client must see before any data is read. Whether the server
    can take the header's transport is the service's question (its backend's capabilities)."""
    if header.transport not in (policy_pb2.WEIGHT_TRANSPORT_UNSPECIFIED, policy_pb2.WEIGHT_TRANSPORT_GRPC_CHUNKS,
                                policy_pb2.WEIGHT_TRANSPORT_NCCL):
        raise InvalidArgument(f"header.transport {header.transport} is not a WeightTransport this server knows",
                              Reason.INVALID_REQUEST)
    expected = {spec.name: spec for spec in manifest}
    specs, seen = [], set()
    for index, tensor in enumerate(header.tensors):
        if tensor.name not in expected:
            raise _bad_weights(f"tensor {tensor.name!r} (header.tensors[{index}]) is not a parameter of "
                               "this model; send exactly the names of its manifest", tensor.name)
        if tensor.name in seen:
            raise _bad_weights(f"tensor {tensor.name!r} appears twice in the header", tensor.name)
        seen.add(tensor.name)
        want = expected[tensor.name]
        if tuple(tensor.shape) != want.shape:
            raise _bad_weights(f"tensor {tensor.name!r} has shape {tuple(tensor.shape)}; the model's is "
                               f"{want.shape}", tensor.name)
        dtype = PROTO_TO_DTYPE.get(tensor.dtype)
        if dtype != want.dtype:
            known = tensor.dtype in policy_pb2.TensorDtype.values()
            got = policy_pb2.TensorDtype.Name(tensor.dtype) if known else str(tensor.dtype)
            raise _bad_weights(f"tensor {tensor.name!r} has dtype {got}; the model holds it as {want.dtype} "
                               f"({policy_pb2.TensorDtype.Name(dtype_to_proto(want.dtype))})", tensor.name)
        specs.append(want)
    missing = [name for name in expected if name not in seen]
    if missing:
        raise _bad_weights(f"tensor {missing[0]!r} is missing from the header ({len(missing)} missing); an "
                           "update must carry every parameter of the model", missing[0])
    total = sum(spec_nbytes(spec) for spec in specs)
    if header.total_bytes != total:
        raise _bad_weights(f"header.total_bytes is {header.total_bytes} but the tensors it lists take {total} "
                           "bytes", "")
    if header.policy_version <= current_version:
        raise FailedPrecondition(f"policy_version {header.policy_version} is not newer than the serving "
                                 f"version {current_version}; send a greater version", Reason.STALE_VERSION,
                                 metadata={"current_version": str(current_version)})
    return specs


def check_provenance(header: policy_pb2.WeightsHeader, model: str) -> DigestCheck:
    """Check an update's provenance and digests before any data is read: a model_id other than
    the served `model`, a checksum that is not 32 bytes, tensor digests on some tensors only, or
    a set digest that is not theirs, is refused. Returns what checks the data against them."""
    provenance = header.provenance
    if provenance.model_id and provenance.model_id != model:
        raise _bad_weights(f"header.provenance.model_id is {provenance.model_id!r} but this server serves "
                           f"{model!r}; send the weights of the model it serves", "")
    if provenance.sha256 and len(provenance.sha256) != _SHA256_BYTES:
        raise _bad_weights(f"header.provenance.sha256 has {len(provenance.sha256)} bytes; a SHA-256 has 32", "")
    with_digest = [spec for spec in header.tensors if spec.digest]
    if with_digest and len(with_digest) != len(header.tensors):
        missing = next(spec.name for spec in header.tensors if not spec.digest)
        raise _bad_weights(f"tensor {missing!r} carries no digest but {len(with_digest)} of the header's "
                           f"{len(header.tensors)} tensors do; give every tensor its digest or none", missing)
    for spec in with_digest:
        if len(spec.digest) != _DIGEST_BYTES:
            raise _bad_weights(f"tensor {spec.name!r} has a digest of {len(spec.digest)} bytes; an XXH3-128 has "
                               f"{_DIGEST_BYTES}", spec.name)
    tensors = [(spec.name, spec.digest) for spec in with_digest]
    if provenance.set_digest:
        if not tensors:
            raise _bad_weights("header.provenance.set_digest is set but no tensor carries a digest; send the "
                               "tensors' digests with it", "")
        if provenance.set_digest != set_digest([digest for _, digest in tensors]):
            raise _bad_weights("header.provenance.set_digest is not the XXH3-128 of the tensors' digests in "
                               "header order; the header is inconsistent", "")
    return DigestCheck(provenance.sha256 or None, tensors)


_SHA256_BYTES = hashlib.sha256().digest_size
_DIGEST_BYTES = 16  # XXH3-128


class DigestMismatch(ValueError):
    """A received tensor whose bytes are not the ones its TensorSpec.digest names."""

    def __init__(self, message: str, tensor: str) -> None:
        super().__init__(message)
        self.tensor = tensor


class DigestCheck:
    """What an update's header says its data is: the SHA-256 of the whole stream (`write`,
    `finish`; WeightsProvenance.sha256) and the digest of each tensor (`verify`, on the tensors
    received, before the swap; TensorSpec.digest)."""

    def __init__(self, expected: bytes | None, tensors: Sequence[tuple[str, bytes]] = ()) -> None:
        self.expected = expected
        self.tensors = list(tensors)  # (name, digest) in header order; empty when the header gave none
        self._hash = hashlib.sha256() if expected else None

    def write(self, chunk: bytes | memoryview) -> None:
        if self._hash is not None:
            self._hash.update(chunk)

    def finish(self) -> None:
        if self._hash is not None and self._hash.digest() != self.expected:
            raise _bad_weights(f"the data's SHA-256 is {self._hash.hexdigest()} but header.provenance.sha256 "
                               f"is {self.expected.hex()}: the update was corrupted or the header is wrong; "
                               "the old weights keep serving", "")

    def verify(self, received: Mapping[str, torch.Tensor]) -> None:
        """Raise DigestMismatch naming the first tensor whose bytes differ from its digest."""
        verify_tensor_digests(self.tensors, received)

    @property
    def set_digest(self) -> bytes:
        return set_digest([digest for _, digest in self.tensors]) if self.tensors else b""


def verify_tensor_digests(expected: Sequence[tuple[str, bytes]], received: Mapping[str, torch.Tensor]) -> None:
    """Each tensor of `received` hashed and compared with its (name, digest) in `expected`;
    DigestMismatch names the first that differs. A no-op when `expected` is empty."""
    for name, digest in expected:
        actual = xxhash.xxh3_128_digest(_byte_view(received[name]))
        if actual != digest:
            raise DigestMismatch(f"tensor {name!r} arrived with XXH3-128 {actual.hex()} but its header says "
                                 f"{digest.hex()}: it was altered in transit or the sender's digest is wrong; "
                                 "the update was refused and the old weights keep serving", name)


def refused(error: DigestMismatch) -> InvalidArgument:
    """The status a receiver answers a DigestMismatch with: INVALID_WEIGHTS naming the tensor."""
    return _bad_weights(str(error), error.tensor)


def _bad_weights(message: str, tensor: str) -> InvalidArgument:
    return InvalidArgument(message, Reason.INVALID_WEIGHTS, metadata={"tensor": tensor} if tensor else None)


class WeightsReceiver:
    """Preallocated tensors that the stream's chunks are copied into, in manifest order; a chunk
    that crosses a tensor boundary is split, none is ever joined with another."""

    def __init__(self, specs: Sequence[TensorSpec]) -> None:
        self.tensors = {spec.name: torch.empty(spec.shape, dtype=getattr(torch, spec.dtype)) for spec in specs}
        self._views = [memoryview(t.reshape(-1).view(torch.uint8).numpy()) for t in self.tensors.values()]
        self.total_bytes = sum(len(view) for view in self._views)
        self.received = 0
        self._tensor = 0  # index of the tensor being filled
        self._offset = 0  # bytes of it already filled

    def write(self, chunk: bytes | memoryview) -> None:
        if self.received + len(chunk) > self.total_bytes:
            raise InvalidArgument(
                f"the stream carries more than header.total_bytes = {self.total_bytes} bytes "
                f"(at least {self.received + len(chunk)}); send exactly the bytes of the listed tensors",
                Reason.WEIGHTS_INCOMPLETE)
        source, position = memoryview(chunk), 0
        while position < len(source):
            target = self._views[self._tensor]
            take = min(len(target) - self._offset, len(source) - position)
            target[self._offset : self._offset + take] = source[position : position + take]
            position += take
            self._offset += take
            if self._offset == len(target):
                self._tensor, self._offset = self._tensor + 1, 0
        self.received += len(chunk)

    def finish(self) -> dict[str, torch.Tensor]:
        if self.received != self.total_bytes:
            raise InvalidArgument(
                f"the stream ended after {self.received} of header.total_bytes = {self.total_bytes} bytes; "
                "send every chunk before closing it", Reason.WEIGHTS_INCOMPLETE)
        return self.tensors
