"""PolicyService over gRPC: Describe, streaming Generate and chunked UpdateWeights, on top of any
PolicyBackend.

Generate: the prompt is tokenized here (so the GeneratePrompt event can go out first and a prompt
longer than the context is refused before any work), then the backend samples from the token ids.
A client that cancels or whose deadline passes cancels the handler, which closes the backend's
iterator, which drops the request's rows from the running batch.

Tracing: a Generate runs in a `chat {model}` span (token counts, policy version, finish reasons),
an update in a `sciproto.policy.update_weights` span (version, bytes), each a child of the span the
request's trace_context names (see `sciproto.tracing.span_for_request`).

UpdateWeights: one update received and applied at a time. A second update of the same target
(the base weights, or one named adapter) that arrives while another is open is refused at once
(FAILED_PRECONDITION, reason UPDATE_IN_PROGRESS, with a retry hint) rather than queued, so a
sender learns immediately that two writers push the same weights; an update of another target
(two training runs, each pushing its own adapter) waits its turn, within its deadline.
A header with transport COLLECTIVE carries no data chunks: the tensors come over the learner's
collective group and the backend's `receive_weights_collective` takes them (vLLM: NCCL on a GPU,
gloo on the CPU; transformers: the gloo group of `sciproto.weights.group`), where its plug-in
declares the capability (policy_server.backends.registry). A backend may still name it
`receive_weights_nccl` and its capability `weight_updates_nccl`, the names before protocol 1.3,
for a release.

LoRA adapters (protocol 1.4): a backend whose plug-in declares `lora_adapters` and that implements
`AdapterBackend` holds named adapters beside its base weights. A header with `adapter` set carries
that adapter's tensors (gRPC chunks only), checked against the adapter's manifest and digests like
any update, and versioned per adapter; a Generate names its adapter, and its prompt event and version
spans carry that adapter's versions. Describe lists the adapters.

Hold (protocol 1.5): a backend that implements `HoldBackend` (both local engines) freezes
generation while a Hold call is open, so that a learner on the same machine has every core for its
step (colocated placement). The call's first message opens the hold (at most `max_hold_s`); the
first answer (HELD) comes once the engine is idle; the caller's half-close releases it and gets a
RELEASED answer; a cancelled call, a caller gone, or `max_seconds` passing releases it too. Holds
from several callers nest. Weight updates still apply while held.

Unavailable weights: when an update fails after the backend began changing the weights (vLLM
loads layer by layer), the backend says so in `info().unavailable`; the server then reports
NOT_SERVING on its health service and refuses Generate with UNAVAILABLE (reason
WEIGHTS_UNAVAILABLE) until a later update completes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
from grpc_health.v1 import health_pb2
from opentelemetry.trace import Span

from policy_server import convert
from policy_server.backends.base import AdapterBackend, HoldBackend, PolicyBackend
from policy_server.backends.registry import Capability
from policy_server.config import PolicyServerConfig
from policy_server.tokenizing import PromptTooLong, Tokenizing
from policy_server.types import BackendInfo, GenerationRequest, SampleResult, TokenDelta
from sciproto.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    Reason,
    ResourceExhausted,
    SciprotoError,
    Unavailable,
    Unimplemented,
    first_line,
)
from sciproto.lora import LoraSpec
from sciproto.pb import POLICY_SERVICE, policy_grpc, policy_pb2
from sciproto.server import server_info
from sciproto.tracing import Attr, Operation, span_for_request, span_name
from sciproto.weights.wire import (
    DTYPE_TO_PROTO,
    DigestCheck,
    DigestMismatch,
    WeightsReceiver,
    check_header,
    check_provenance,
    parse_request,
    refused,
)

# Turns a chat or token request into the exact prompt ids the model will see.
PromptTokenizer = Callable[[GenerationRequest], list[int]]

log = logging.getLogger(__name__)

WEIGHTS_BYTES = "sciproto.weights.bytes"  # span attribute: bytes of tensor data an update received

CAPABILITIES = ["generate.chat", "generate.tokens", "generate.multi_turn_token_ids", "generate.n_samples"]
WEIGHTS_CAPABILITY = "weights.grpc_chunks"
HOLD_CAPABILITY = "hold"  # takes Hold (protocol 1.5)
COLLECTIVE_CAPABILITY = "weight_updates_collective"  # a backend capability: takes collective-transport headers
NCCL_CAPABILITY = "weight_updates_nccl"  # its name before protocol 1.3 (deprecated), reported beside it for a release


class PolicyServicer(policy_grpc.PolicyServiceServicer):
    def __init__(self, backend: PolicyBackend, tokenize: PromptTokenizer, config: PolicyServerConfig,
                 longest_token_chars: int | None = None, *, capabilities: frozenset[Capability]) -> None:
        self._backend = backend
        self._declared = capabilities  # what the backend's plug-in declares (policy_server.backends.registry)
        # Long prompts are tokenized off the event loop, and one that cannot fit is refused before
        # tokenizing (policy_server.tokenizing).
        self._tokenize = Tokenizing(tokenize, lambda: self._backend.info().max_context, longest_token_chars)
        self._config = config
        self._active: set[object] = set()  # one token per running Generate call
        self._update_lock = asyncio.Lock()  # one update received and applied at a time
        self._updating: set[str] = set()  # what updates are open for: "" (base weights), adapter names
        self._weights_run_id = ""  # WeightsProvenance.run_id of the update serving now
        self._serving_digests = DigestCheck(None)  # the checked tensor digests of the update serving now
        # Per adapter: WeightsProvenance.run_id and the checked set digest of its update serving now.
        self._adapter_provenance: dict[str, tuple[str, bytes]] = {}
        # The server's health service (set by the app once the server runs): NOT_SERVING while the
        # backend's weights are unavailable.
        self.health: object | None = None

    # -- Describe ----------------------------------------------------------------------------------

    async def Describe(self, request: policy_pb2.PolicyServiceDescribeRequest,
                       context: grpc.aio.ServicerContext) -> policy_pb2.PolicyServiceDescribeResponse:
        info = self._backend.info()
        capabilities = CAPABILITIES + ([WEIGHTS_CAPABILITY] if info.supports_weight_updates else []) \
            + ([HOLD_CAPABILITY] if isinstance(self._backend, HoldBackend) else [])
        server = server_info(self._config.server, "sciproto-policy",
                             capabilities + [f"backend.{name}" for name in info.capabilities],
                             service=POLICY_SERVICE, auth=self._config.auth)
        return policy_pb2.PolicyServiceDescribeResponse(
            server=server, model=info.model, backend=info.backend,
            dtype=DTYPE_TO_PROTO.get(info.dtype, policy_pb2.TENSOR_DTYPE_UNSPECIFIED),
            quantization=info.quantization, max_context_tokens=info.max_context,
            policy_version=info.policy_version, supports_weight_updates=info.supports_weight_updates,
            active_requests=len(self._active), weights_run_id=self._weights_run_id,
            weights_digest=self._serving_digests.set_digest,
            serving_tensors=[policy_pb2.TensorSpec(name=name, digest=digest)
                             for name, digest in self._serving_digests.tensors],
            **self._describe_adapters(),
        )

    def _adapter_backend(self) -> AdapterBackend | None:
        """The backend as an AdapterBackend when it serves adapters now, else None."""
        backend = self._backend
        if (Capability.LORA_ADAPTERS in self._declared and isinstance(backend, AdapterBackend)
                and backend.max_adapters > 0 and backend.info().supports_weight_updates):
            return backend
        return None

    def _describe_adapters(self) -> dict:
        backend = self._adapter_backend()
        if backend is None:
            return {}
        adapters = []
        for name, state in sorted(backend.adapters().items()):
            run_id, digest = self._adapter_provenance.get(name, ("", b""))
            adapters.append(policy_pb2.AdapterServing(adapter=state.spec.to_proto(), policy_version=state.version,
                                                      weights_run_id=run_id, weights_digest=digest))
        return {"adapters": adapters, "max_adapters": backend.max_adapters,
                "max_adapter_rank": backend.max_adapter_rank}

    def _adapter_version(self, name: str) -> int:
        """The version of the adapter a Generate names, or NOT_FOUND (UNKNOWN_ADAPTER) naming the ones held."""
        backend = self._adapter_backend()
        held = backend.adapters() if backend is not None else {}
        if name not in held:
            where = (f"it holds {', '.join(sorted(held))}" if held else "it holds none yet") if backend else \
                f"the {self._backend.info().backend} backend serves no adapters"
            raise NotFound(f"this policy server holds no adapter named {name!r} ({where}); push it with an "
                           "UpdateWeights whose header names it, or leave `adapter` empty for the base weights",
                           Reason.UNKNOWN_ADAPTER, metadata={"adapter": name})
        return held[name].version

    # -- Generate ----------------------------------------------------------------------------------

    async def Generate(self, request: policy_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[policy_pb2.GenerateResponse]:
        model = self._backend.info().model
        with span_for_request(span_name(Operation.CHAT, model), context, request.trace_context,
                              **{Attr.GEN_AI_OPERATION_NAME: Operation.CHAT, Attr.GEN_AI_REQUEST_MODEL: model}) as span:
            info = self._backend.info()
            if info.unavailable:
                raise Unavailable(f"this server cannot sample now: {info.unavailable}", Reason.WEIGHTS_UNAVAILABLE,
                                  retry_after_s=5.0)
            backend_request = await self._backend_request(request)
            version = self._adapter_version(request.adapter) if request.adapter else info.policy_version
            _record_request(span, backend_request, version)
            samples: list[SampleResult] = []
            call = object()
            self._active.add(call)
            try:
                yield convert.prompt_event(backend_request.prompt_token_ids, version)
                async with contextlib.aclosing(self._backend.generate(backend_request)) as events:
                    async for event in events:
                        if isinstance(event, TokenDelta):
                            yield convert.delta_event(event)
                        else:
                            samples.append(event)
                            yield convert.sample_event(event)
            except ValueError as error:  # the backend refused the request before sampling
                raise InvalidArgument(f"{error}", Reason.INVALID_REQUEST) from error
            finally:
                self._active.discard(call)
                _record_samples(span, samples)

    async def _backend_request(self, request: policy_pb2.GenerateRequest) -> GenerationRequest:
        """The request as prompt token ids, or InvalidArgument saying what to fix."""
        max_samples = self._config.max_samples_per_request
        try:
            parsed = convert.generation_request(request, self._config.default_max_tokens, max_samples)
            prompt = await self._tokenize(parsed)
        except PromptTooLong as error:
            raise InvalidArgument(f"{error}", Reason.PROMPT_TOO_LONG, metadata={
                "prompt_chars": str(error.chars), "prompt_tokens_at_least": str(error.at_least),
                "max_context_tokens": str(error.max_context)}) from error
        except ValueError as error:
            raise InvalidArgument(f"{error}", Reason.INVALID_REQUEST) from error
        max_context = self._backend.info().max_context
        if len(prompt) >= max_context:
            raise InvalidArgument(
                f"the prompt has {len(prompt)} tokens; the model's context holds {max_context} tokens of prompt "
                "and completion together: shorten the conversation", Reason.PROMPT_TOO_LONG,
                metadata={"prompt_tokens": str(len(prompt)), "max_context_tokens": str(max_context)})
        return GenerationRequest(prompt_token_ids=prompt, sampling=parsed.sampling, request_id=parsed.request_id,
                                 adapter=request.adapter)

    # -- UpdateWeights -----------------------------------------------------------------------------

    async def UpdateWeights(self, request_iterator: AsyncIterator[policy_pb2.UpdateWeightsRequest | memoryview],
                            context: grpc.aio.ServicerContext) -> policy_pb2.UpdateWeightsResponse:
        try:
            if not (Capability.WEIGHT_UPDATES in self._declared and self._backend.info().supports_weight_updates):
                raise Unimplemented(f"the {self._backend.info().backend} backend cannot change its weights",
                                    Reason.UNSUPPORTED)
            first = await self._next_message(request_iterator)
            if not isinstance(first, policy_pb2.UpdateWeightsRequest) or first.WhichOneof("chunk") != "header":
                raise InvalidArgument("the first message of UpdateWeights must be the header", Reason.INVALID_REQUEST)
            header = first.header
            target = header.adapter.name if header.HasField("adapter") else ""
            if target in self._updating:
                what = f"adapter {target!r}" if target else "the base weights"
                raise FailedPrecondition(f"another update of {what} is in progress on this server; retry when it "
                                         "has finished, and send updates of one model or adapter from one place only",
                                         Reason.UPDATE_IN_PROGRESS, retry_after_s=1.0)
            self._updating.add(target)
            try:
                async with self._update_lock:  # an update of another target waits its turn
                    with span_for_request(span_name(Operation.UPDATE_WEIGHTS), context, header.trace_context,
                                          **{Attr.POLICY_VERSION: header.policy_version}) as span:
                        return await self._apply_update(header, request_iterator, span)
            finally:
                self._updating.discard(target)
        except SciprotoError as error:
            if not isinstance(error, DeadlineExceeded):  # a stalled stream has nothing left to read
                await self._drain(request_iterator)
            raise

    async def _drain(self, request_iterator: AsyncIterator[policy_pb2.UpdateWeightsRequest | memoryview]) -> None:
        """Read and drop what is left of a refused update (outside the update lock), for at most
        `weights.refused_drain_s`, before the refusal goes out. grpcio's asyncio client loses the
        server's status when one of its writes meets a call the server has already ended: it reports
        INTERNAL ("Internal error from Core") instead (grpc/grpc#36066). A client that has written
        everything gets the refusal's own code and reason. Data chunks are not parsed, so this costs
        little more than the bytes."""
        try:
            async with asyncio.timeout(self._config.weights.refused_drain_s):
                async for _ in request_iterator:
                    pass
        except (TimeoutError, grpc.aio.AioRpcError, asyncio.InvalidStateError):
            pass  # past the bound, or the client went away: answer now

    async def _apply_update(self, header: policy_pb2.WeightsHeader,
                            request_iterator: AsyncIterator[policy_pb2.UpdateWeightsRequest | memoryview],
                            span: Span) -> policy_pb2.UpdateWeightsResponse:
        """Receive the data chunks of an update whose header came first, and apply it."""
        if header.HasField("adapter"):
            return await self._apply_adapter_update(header, request_iterator, span)
        specs = check_header(header, self._backend.weight_manifest(), self._backend.info().policy_version)
        digest = check_provenance(header, self._backend.info().model)
        if header.transport == policy_pb2.WEIGHT_TRANSPORT_COLLECTIVE:
            return await self._apply_collective_update(header, specs, digest, request_iterator)
        tensors, received = await self._receive(specs, digest, request_iterator)
        running_before = set(self._active)
        start = time.perf_counter()
        await self._run_update(header.policy_version, self._backend.update_weights(header.policy_version, tensors))
        self._weights_run_id = header.provenance.run_id
        self._serving_digests = digest
        span.set_attribute(WEIGHTS_BYTES, received)
        return self._update_response(received, time.perf_counter() - start, running_before)

    async def _apply_adapter_update(self, header: policy_pb2.WeightsHeader,
                                    request_iterator: AsyncIterator[policy_pb2.UpdateWeightsRequest | memoryview],
                                    span: Span) -> policy_pb2.UpdateWeightsResponse:
        """An update of one LoRA adapter: checked against that adapter's manifest and version, the
        base weights and the other adapters left as they are."""
        backend = self._adapter_backend()
        if backend is None:
            raise Unimplemented(f"this {self._backend.info().backend} policy server serves no LoRA adapters "
                                "(adapters.max_adapters is 0, or the backend has none); push full weights",
                                Reason.UNSUPPORTED)
        if header.transport == policy_pb2.WEIGHT_TRANSPORT_COLLECTIVE:
            raise Unimplemented("adapter updates travel as gRPC chunks (they are small); send transport "
                                "WEIGHT_TRANSPORT_GRPC_CHUNKS", Reason.UNSUPPORTED)
        try:
            spec = LoraSpec.from_proto(header.adapter)
            if spec.rank > backend.max_adapter_rank:
                raise ValueError(f"adapter {spec.name!r} has rank {spec.rank}; this server takes ranks up to "
                                 f"{backend.max_adapter_rank} (adapters.max_rank)")
            manifest = backend.adapter_manifest(spec)
        except ValueError as error:
            raise InvalidArgument(f"header.adapter: {first_line(error)}", Reason.INVALID_WEIGHTS) from error
        held = backend.adapters()
        if spec.name in held and held[spec.name].spec != spec:
            raise InvalidArgument(f"adapter {spec.name!r} is loaded with rank {held[spec.name].spec.rank}, alpha "
                                  f"{held[spec.name].spec.alpha} and modules {list(held[spec.name].spec.target_modules)}"
                                  "; an update keeps its shape: push it under a new name to change it",
                                  Reason.INVALID_WEIGHTS)
        if spec.name not in held and len(held) >= backend.max_adapters:
            raise ResourceExhausted(f"this policy server holds {len(held)} adapters ({', '.join(sorted(held))}), its "
                                    f"adapters.max_adapters; update one of them, or raise the limit",
                                    Reason.TOO_MANY_ADAPTERS, metadata={"max_adapters": str(backend.max_adapters)})
        current = held[spec.name].version if spec.name in held else -1
        specs = check_header(header, manifest, current)
        digest = check_provenance(header, self._backend.info().model)  # model_id: the adapter's base model
        tensors, received = await self._receive(specs, digest, request_iterator)
        running_before = set(self._active)
        start = time.perf_counter()
        await self._run_update(header.policy_version, backend.update_adapter(spec, header.policy_version, tensors))
        self._adapter_provenance[spec.name] = (header.provenance.run_id, digest.set_digest)
        span.set_attribute(WEIGHTS_BYTES, received)
        response = self._update_response(received, time.perf_counter() - start, running_before)
        response.policy_version = header.policy_version
        return response

    async def _receive(self, specs: list, digest: DigestCheck,
                       request_iterator: AsyncIterator[policy_pb2.UpdateWeightsRequest | memoryview]
                       ) -> tuple[dict, int]:
        """The tensors of the data chunks after the header, checked against their digests before
        anything is swapped in, and how many bytes came."""
        receiver = WeightsReceiver(specs)
        while (message := await self._next_message(request_iterator)) is not None:
            if not isinstance(message, memoryview):  # else a data chunk, read without parsing (parse_request)
                if message.WhichOneof("chunk") != "data":
                    raise InvalidArgument("only the first message of UpdateWeights may be a header; the rest "
                                          "must be data chunks", Reason.INVALID_REQUEST)
                message = memoryview(message.data)
            receiver.write(message)
            digest.write(message)
        tensors = receiver.finish()
        # before the swap: a corrupted update never serves
        digest.finish()
        try:
            await asyncio.to_thread(digest.verify, tensors)  # hashed in a thread: Generate goes on meanwhile
        except DigestMismatch as error:
            raise refused(error) from error
        return tensors, receiver.received

    async def _apply_collective_update(self, header: policy_pb2.WeightsHeader, specs: list, digest: DigestCheck,
                                       request_iterator: AsyncIterator[policy_pb2.UpdateWeightsRequest | memoryview]
                                       ) -> policy_pb2.UpdateWeightsResponse:
        """A collective-transport header: the tensors come over the collective group; the backend
        checks them against the header's digests where their bytes reach its CPU (gloo), and
        says whether it did."""
        info = self._backend.info()
        receive = self._collective_receiver(info)
        if receive is None:
            raise Unimplemented(f"this {info.backend} server takes no collective weight transfer (configure "
                                "weights.collective); send transport "
                                "WEIGHT_TRANSPORT_GRPC_CHUNKS", Reason.UNSUPPORTED)
        if await self._next_message(request_iterator) is not None:
            raise InvalidArgument("an UpdateWeights stream with transport COLLECTIVE carries only the header",
                                  Reason.INVALID_REQUEST)
        running_before = set(self._active)
        start = time.perf_counter()
        checked = await self._run_update(header.policy_version, receive(header.policy_version, specs, digest.tensors))
        self._weights_run_id = header.provenance.run_id
        self._serving_digests = digest if checked else DigestCheck(None)
        return self._update_response(header.total_bytes, time.perf_counter() - start, running_before)

    def _collective_receiver(self, info: BackendInfo) -> Callable[..., Awaitable[bool]] | None:
        """The backend's receiver of collective-transport updates, when it takes them now: its
        plug-in declares it, and its info reports the capability (a transformers server only with
        weights.collective configured)."""
        if (Capability.COLLECTIVE_WEIGHTS not in self._declared
                or not {COLLECTIVE_CAPABILITY, NCCL_CAPABILITY} & set(info.capabilities)):
            return None
        return (getattr(self._backend, "receive_weights_collective", None)
                or getattr(self._backend, "receive_weights_nccl", None))  # the name before 1.3

    async def _run_update(self, version: int, update: Awaitable[object]) -> object:
        """Await the backend's update; map its failure to the status the sender must see, and keep
        the health service in step with whether the weights are whole."""
        try:
            return await update
        except DigestMismatch as error:
            raise refused(error) from error
        except ValueError as error:
            raise InvalidArgument(f"{error}", Reason.INVALID_WEIGHTS) from error
        except (TimeoutError, RuntimeError) as error:
            unavailable = self._backend.info().unavailable
            if unavailable:  # what it holds now is no update's: nothing checked serves
                self._serving_digests = DigestCheck(None)
            after = (f"this server is NOT_SERVING until a complete update: {unavailable}" if unavailable
                     else "the old weights keep serving")
            kind = DeadlineExceeded if isinstance(error, TimeoutError) else Unavailable
            raise kind(f"the update to policy version {version} failed ({error or type(error).__name__}); {after}",
                       Reason.WEIGHTS_UNAVAILABLE if unavailable else Reason.WEIGHTS_INCOMPLETE) from error
        finally:
            await self._report_health()

    def _update_response(self, received: int, seconds: float, running_before: set[object]
                         ) -> policy_pb2.UpdateWeightsResponse:
        return policy_pb2.UpdateWeightsResponse(
            policy_version=self._backend.info().policy_version,
            bytes_received=received,
            apply_seconds=seconds,
            # calls that were running before the swap and still are after it
            requests_spanning_versions=len(running_before & self._active),
        )

    async def _report_health(self) -> None:
        if self.health is None:
            return
        status = (health_pb2.HealthCheckResponse.NOT_SERVING if self._backend.info().unavailable
                  else health_pb2.HealthCheckResponse.SERVING)
        for name in ("", POLICY_SERVICE):
            await self.health.set(name, status)  # type: ignore[attr-defined]

    # -- Hold ------------------------------------------------------------------------------------

    async def Hold(self, request_iterator: AsyncIterator[policy_pb2.HoldRequest],
                   context: grpc.aio.ServicerContext) -> AsyncIterator[policy_pb2.HoldResponse]:
        backend = self._backend
        if not isinstance(backend, HoldBackend):
            raise Unimplemented(f"the {backend.info().backend} backend cannot hold generation", Reason.UNSUPPORTED)
        limit = self._config.max_hold_s
        try:
            first = await asyncio.wait_for(anext(request_iterator, None), self._config.weights.chunk_timeout_s)
        except TimeoutError as error:
            raise InvalidArgument(f"no HoldRequest arrived within {self._config.weights.chunk_timeout_s:.0f} s;"
                                  " send one to open the hold", Reason.INVALID_REQUEST) from error
        if first is None:
            return  # closed before asking: nothing held
        if not math.isfinite(first.max_seconds) or first.max_seconds < 0:
            raise InvalidArgument(f"max_seconds must be 0 (the server's {limit:g} s) or a positive number of "
                                  f"seconds, not {first.max_seconds}", Reason.INVALID_REQUEST)
        seconds = min(first.max_seconds or limit, limit)
        # Opened and released as tasks of their own: a caller that leaves while the engine takes the
        # hold still has it released, and a release is never cut short.
        opening = asyncio.ensure_future(backend.hold())
        try:
            held_at, frozen = await asyncio.shield(opening)
        except asyncio.CancelledError:
            opening.add_done_callback(lambda task: task.exception() is None and asyncio.ensure_future(backend.release()))
            raise
        if first.reason:
            log.info("generation held (%s; at most %.0f s, %d requests frozen)", first.reason, seconds, frozen)
        reason = "max_seconds"
        try:
            yield policy_pb2.HoldResponse(state=policy_pb2.HOLD_STATE_HELD, held_at_unix_s=held_at,
                                          requests_held=frozen)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(seconds):
                    async for _ in request_iterator:
                        pass  # only the first message means anything; the half-close releases
                    reason = "released"
        finally:
            releasing = asyncio.ensure_future(backend.release())
            with contextlib.suppress(asyncio.CancelledError):
                released_at = await asyncio.shield(releasing)
        yield policy_pb2.HoldResponse(state=policy_pb2.HOLD_STATE_RELEASED, held_at_unix_s=held_at,
                                      released_at_unix_s=released_at, release_reason=reason, requests_held=frozen)

    async def _next_message(self, requests: AsyncIterator[policy_pb2.UpdateWeightsRequest | memoryview]
                            ) -> policy_pb2.UpdateWeightsRequest | memoryview | None:
        timeout = self._config.weights.chunk_timeout_s
        try:
            return await asyncio.wait_for(anext(requests, None), timeout)
        except TimeoutError as error:
            raise DeadlineExceeded(f"no UpdateWeights message arrived for {timeout:.0f} s; the update was "
                                   "dropped and the old weights keep serving", Reason.WEIGHTS_INCOMPLETE) from error

    async def aclose(self) -> None:
        self._tokenize.close()
        await self._backend.close()



def _record_request(span: Span, request: GenerationRequest, policy_version: int) -> None:
    if span.is_recording():
        sampling = request.sampling
        span.set_attributes({
            Attr.GEN_AI_REQUEST_MAX_TOKENS: sampling.max_tokens, Attr.GEN_AI_REQUEST_TEMPERATURE: sampling.temperature,
            Attr.GEN_AI_REQUEST_TOP_P: sampling.top_p, Attr.GEN_AI_REQUEST_CHOICE_COUNT: sampling.n,
            Attr.GEN_AI_USAGE_INPUT_TOKENS: len(request.prompt_token_ids), Attr.POLICY_VERSION: policy_version,
        })


def _record_samples(span: Span, samples: list[SampleResult]) -> None:
    """Output tokens = the completion tokens of every sample; finish reasons in sample order."""
    if span.is_recording():
        ordered = sorted(samples, key=lambda sample: sample.sample_index)
        span.set_attributes({
            Attr.GEN_AI_USAGE_OUTPUT_TOKENS: sum(len(sample.completion_token_ids) for sample in ordered),
            Attr.GEN_AI_RESPONSE_FINISH_REASONS: [sample.finish_reason.value for sample in ordered],
        })


def register(servicer: PolicyServicer, server: grpc.aio.Server) -> None:
    """The generated registration, except that UpdateWeights reads its data chunks with
    `parse_request` (views of the received bytes) instead of protobuf parsing."""
    def handler(kind: Callable[..., grpc.RpcMethodHandler], method: Callable[..., object],
                request: Callable[[bytes], object], response: type) -> grpc.RpcMethodHandler:
        return kind(method, request_deserializer=request, response_serializer=response.SerializeToString)

    handlers = {
        "Describe": handler(grpc.unary_unary_rpc_method_handler, servicer.Describe,
                            policy_pb2.PolicyServiceDescribeRequest.FromString, policy_pb2.PolicyServiceDescribeResponse),
        "Generate": handler(grpc.unary_stream_rpc_method_handler, servicer.Generate,
                            policy_pb2.GenerateRequest.FromString, policy_pb2.GenerateResponse),
        "UpdateWeights": handler(grpc.stream_unary_rpc_method_handler, servicer.UpdateWeights,
                                 parse_request, policy_pb2.UpdateWeightsResponse),
        "Hold": handler(grpc.stream_stream_rpc_method_handler, servicer.Hold,
                        policy_pb2.HoldRequest.FromString, policy_pb2.HoldResponse),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(POLICY_SERVICE, handlers),))
    server.add_registered_method_handlers(POLICY_SERVICE, handlers)
