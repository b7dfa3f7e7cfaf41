"""The `transformers` backend: dynamic batching over one model, for CPU and small GPUs.

One engine thread owns the model. Concurrent `generate` calls land in an inbox; when the engine is
idle it keeps collecting arrivals until none has come for `batch_window_s` (at most
`BATCH_WINDOW_LIMIT` windows in all, so a steady trickle cannot hold the first back), prefills them
together and decodes all their samples in one batched loop over a shared KV cache. Calls that arrive while a batch is decoding
are prefilled and merged into it between two decode steps. Weight updates are applied between
decode steps too: each token is sampled by one version's weights, and a sample running across an
update goes on over the KV cache the old weights computed (its version spans say where; the
learner counts those tokens as sampled by no single version, `learner.grpo.whole_versions`).

LoRA adapters (protocol 1.4, `AdapterBackend`): besides its base weights the backend holds up to
`max_adapters` named adapters of rank up to `max_adapter_rank` (the config's `adapters:` section).
The model is never wrapped: a request naming an adapter has its rows' outputs of each targeted
linear layer raised by that adapter's `scale * B A x` (`policy_server.backends.lora_rows`), so base
rows and rows of different adapters decode in one batch, and a batch of base rows only runs with
no adapter hook at all. An adapter is added or replaced between decode steps like a full-weight
update; the base weights and the other adapters stay as they are. Versions are per adapter: a
sample's version spans carry its adapter's versions (the base's for a base sample), and only an
update of that adapter starts a new span in it. A full-weight update changes what adapter samples
are drawn from too, yet starts no span in them: their spans track the adapter's version only (a
server shared by LoRA runs takes no full-weight updates, `policy.address`).
"""

from __future__ import annotations

import asyncio
import queue
import random
import secrets
import threading
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from policy_server.backends.base import CAPABILITIES as BASE_CAPABILITIES
from policy_server.backends.base import COLLECTIVE_CAPABILITIES
from policy_server.backends.decode_batch import DecodeBatch
from policy_server.backends.lora_rows import LoraRows, LoraWeights, Routing
from policy_server.backends.sampling import sample_next_tokens
from policy_server.toolcalls import parse_completion
from policy_server.types import (
    AdapterState,
    BackendInfo,
    FinishReason,
    GenerationRequest,
    SampleResult,
    SamplingParams,
    TensorSpec,
    TokenDelta,
    VersionSpan,
    dtype_name,
    validate_weight_update,
)
from sciproto.lora import LoraSpec
from sciproto.models import LoadedModel, load_model
from sciproto.prompts import prompt_token_ids
from sciproto.weights.group import WeightGroup
from sciproto.weights.rendezvous import CollectiveRendezvous
from sciproto.weights.wire import verify_tensor_digests

if TYPE_CHECKING:
    from policy_server.config import PolicyServerConfig


@dataclass
class _Job:
    """One generate call: its prompt, and the queue its events go back to."""

    prompt: list[int]
    sampling: SamplingParams
    max_new_tokens: int
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    adapter: str = ""  # the LoRA adapter its samples use; "": the base weights
    cancelled: bool = False


@dataclass
class _Row:
    """One sample being decoded."""

    job: _Job
    sample_index: int
    rng: random.Random
    version_marks: list[tuple[int, int]]  # (token index, version from that token on)
    sampled: bool = field(init=False)  # temperature > 0: draws from `rng` each step
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    # incremental detokenization: text == decode(tokens[:read_offset]) over whole characters
    text: str = ""
    prefix_offset: int = 0
    read_offset: int = 0
    stop_checked_chars: int = 0
    sent_tokens: int = 0
    sent_chars: int = 0

    def __post_init__(self) -> None:
        self.sampled = self.job.sampling.temperature > 0


@dataclass
class _WeightUpdate:
    version: int
    tensors: Mapping[str, torch.Tensor]
    done: Future


@dataclass
class _AdapterUpdate:
    weights: LoraWeights  # already on the model's device: installing it swaps a reference
    done: Future


@dataclass
class _Hold:
    """Open (`opens`) or close a hold; the engine answers with the time it took effect."""

    opens: bool
    done: Future


_CLOSE = object()

# An idle engine waits for a burst of calls to end, but not longer than this many batch windows.
# Calls sent together reach the engine spread over several milliseconds (each passes the gRPC
# layer and the tokenizer first); one that misses the first prefill joins a step later and its
# rows finish last, so a fixed window after the first arrival would stretch the whole burst.
BATCH_WINDOW_LIMIT = 10


class TransformersBackend:
    """PolicyBackend and AdapterBackend over a `LoadedModel`. `stream_interval` is how many tokens
    a sample gathers before a TokenDelta goes out; `stall_timeout_s` bounds the wait for the next
    event; `max_adapters` LoRA adapters of rank up to `max_adapter_rank` are served beside the base
    weights (0: none)."""

    def __init__(
        self,
        loaded: LoadedModel,
        batch_window_s: float = 0.005,
        max_batch_rows: int = 256,
        stream_interval: int = 8,
        stall_timeout_s: float = 600.0,
        collective: CollectiveRendezvous | None = None,
        max_adapters: int = 4,
        max_adapter_rank: int = 64,
    ) -> None:
        if batch_window_s < 0 or max_batch_rows < 1 or stream_interval < 1 or stall_timeout_s <= 0:
            raise ValueError(
                "need batch_window_s >= 0, max_batch_rows >= 1, stream_interval >= 1, "
                "stall_timeout_s > 0"
            )
        self._loaded = loaded
        self._model = loaded.model
        self._tokenizer = loaded.tokenizer
        self._batch_window_s = batch_window_s
        self._max_batch_rows = max_batch_rows
        self._stream_interval = stream_interval
        self._stall_timeout_s = stall_timeout_s
        self._stop_ids = loaded.stop_token_ids
        self._pad_id = loaded.tokenizer.pad_token_id
        self._manifest = [
            TensorSpec(name, tuple(param.shape), dtype_name(param.dtype))
            for name, param in self._model.named_parameters()
        ]
        self._parameters = dict(self._model.named_parameters())
        self._version = 0
        self._lora = LoraRows(self._model, dtype_name(self._model.dtype), max_adapters, max_adapter_rank)
        self.max_adapters = max_adapters
        self.max_adapter_rank = max_adapter_rank
        self._routing_key: tuple[object, object] | None = None  # (rows, held adapters) `_routing` was built for
        self._routing: Routing | None = None
        self._inbox: queue.Queue = queue.Queue()
        self._waiting: list[_Job] = []  # taken from the inbox, not yet prefilled
        self._prefilling: list[_Job] = []  # admitted this step, rows not yet created
        self._rows: list[_Row] = []
        self._sampling_rows: list[_Row] | None = None  # the rows `_sampling` was built for
        self._sampling: tuple[torch.Tensor, ...] = (torch.empty(0), torch.empty(0), torch.empty(0))
        self._batch: DecodeBatch | None = None
        self._next_tokens: torch.Tensor | None = None
        self._engine_lock = threading.Lock()  # held while the model runs or weights change
        self._holds = 0  # open holds (HoldBackend): no forward pass runs while any is open
        self._thread: threading.Thread | None = None
        self._closed = False
        # the learner's gloo weight-transfer group, when this server takes collective-transport headers
        self._weight_group = None if collective is None else WeightGroup(collective, collective.rank_offset)

    # -- PolicyBackend -------------------------------------------------------------------------

    def info(self) -> BackendInfo:
        return BackendInfo(
            model=self._loaded.name,
            backend="transformers",
            dtype=dtype_name(self._model.dtype),
            quantization="",
            max_context=self._loaded.max_context,
            policy_version=self._version,
            capabilities=list(BASE_CAPABILITIES) + (COLLECTIVE_CAPABILITIES if self._weight_group else [])
            + (["lora_adapters"] if self.max_adapters > 0 else []),
            supports_weight_updates=True,
        )

    @property
    def tokenizer(self) -> Any:
        """The Hugging Face tokenizer prompts are rendered with."""
        return self._tokenizer

    def prompt_token_ids(self, request: GenerationRequest) -> list[int]:
        return prompt_token_ids(self._tokenizer, request, self._stop_ids)

    async def generate(
        self, request: GenerationRequest
    ) -> AsyncIterator[TokenDelta | SampleResult]:
        if self._closed:
            raise RuntimeError("backend is closed")
        if request.adapter and request.adapter not in self._lora.held:
            held = ", ".join(sorted(self._lora.held)) or "none"
            raise ValueError(f"no adapter named {request.adapter!r} is loaded (loaded: {held})")
        prompt = prompt_token_ids(self._tokenizer, request, self._stop_ids)
        room = self._loaded.max_context - len(prompt)
        if room < 1:
            raise ValueError(
                f"prompt has {len(prompt)} tokens; the model's context is {self._loaded.max_context}"
            )
        job = _Job(
            prompt=prompt,
            sampling=request.sampling,
            max_new_tokens=min(request.sampling.max_tokens, room),
            loop=asyncio.get_running_loop(),
            events=asyncio.Queue(),
            adapter=request.adapter,
        )
        self._start_engine()
        self._inbox.put(job)
        unfinished = request.sampling.n
        try:
            while unfinished:
                event = await asyncio.wait_for(job.events.get(), self._stall_timeout_s)
                if isinstance(event, BaseException):
                    raise event
                if isinstance(event, SampleResult):
                    unfinished -= 1
                yield event
        finally:
            job.cancelled = unfinished > 0  # the caller left early: the engine drops its rows

    def weight_manifest(self) -> list[TensorSpec]:
        return list(self._manifest)

    async def update_weights(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        validate_weight_update(self._manifest, tensors)
        if version <= self._version:
            raise ValueError(
                f"version {version} is not newer than the serving version {self._version}"
            )
        if self._closed:
            raise RuntimeError("backend is closed")
        await self._submit(_WeightUpdate(version, tensors, Future()))

    async def _submit(self, update: _WeightUpdate | _AdapterUpdate) -> None:
        """Hand an update to the engine, which applies it between two decode steps, and wait."""
        self._start_engine()
        self._inbox.put(update)
        try:
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(update.done)), self._stall_timeout_s)
        except (TimeoutError, asyncio.CancelledError):
            # The caller gives up: an update still waiting in the inbox is withdrawn and never
            # applied; one the engine already began applying (a copy between two decode steps)
            # completes, and then it is the serving version.
            if update.done.cancel():
                raise
            await asyncio.to_thread(update.done.exception, self._stall_timeout_s)
            if update.done.exception() is not None:
                raise update.done.exception() from None
            if asyncio.current_task().cancelling():  # type: ignore[union-attr]
                raise

    # -- AdapterBackend --------------------------------------------------------------------------

    def adapters(self) -> dict[str, AdapterState]:
        return self._lora.states()

    def adapter_manifest(self, spec: LoraSpec) -> list[TensorSpec]:
        return self._lora.manifest(spec)

    async def update_adapter(self, spec: LoraSpec, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Validate (ValueError naming the tensor, or saying why the adapter cannot be taken:
        past max_adapters, another shape under a held name, a version not newer; nothing changes),
        copy the tensors to the model's device, and install them between two decode steps."""
        validate_weight_update(self._lora.manifest(spec), tensors)
        self._lora.check_room(spec, version)
        if self._closed:
            raise RuntimeError("backend is closed")
        weights = await asyncio.to_thread(self._lora.prepare, spec, version, tensors)
        await self._submit(_AdapterUpdate(weights, Future()))

    async def receive_weights_collective(self, version: int, specs: list[TensorSpec],
                                   digests: Sequence[tuple[str, bytes]] = ()) -> bool:
        """Take an update whose tensors the learner broadcasts over the gloo weight-transfer group
        (`sciproto.weights.group`), in the order of `specs` (the header, already checked
        against the manifest). They land in fresh tensors, which are checked against the header's
        `digests` (name, digest; DigestMismatch names the first that differs); the swap is
        `update_weights`, so a transfer that fails, times out or was altered leaves the old weights
        serving. Returns whether the digests were checked (True when there were any)."""
        group = self._weight_group
        if group is None:
            raise RuntimeError("this server has no weights.collective rendezvous configured")
        if version <= self._version:
            raise ValueError(f"version {version} is not newer than the serving version {self._version}")

        def receive() -> dict[str, torch.Tensor]:
            try:
                group.form()
                return group.receive(specs)
            except BaseException:
                group.discard()  # the next update forms a new group
                raise

        tensors = await asyncio.wait_for(asyncio.to_thread(receive), self._stall_timeout_s)
        await asyncio.to_thread(verify_tensor_digests, digests, tensors)
        await self.update_weights(version, tensors)
        return bool(digests)

    # -- HoldBackend ------------------------------------------------------------------------------

    async def hold(self) -> tuple[float, int]:
        """Open a hold between two decode steps: (its wall-clock start, requests frozen)."""
        return await self._submit_hold(True)

    async def release(self) -> float:
        """Close a hold; the decode loop goes on once none is open."""
        at, _ = await self._submit_hold(False)
        return at

    async def _submit_hold(self, opens: bool) -> tuple[float, int]:
        if self._closed:
            raise RuntimeError("backend is closed")
        command = _Hold(opens, Future())
        self._start_engine()
        self._inbox.put(command)
        # The engine takes commands between decode steps: at most one step's wait.
        return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(command.done)), self._stall_timeout_s)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._weight_group is not None:
            self._weight_group.close()
        if self._thread is not None:
            self._inbox.put(_CLOSE)
            await asyncio.to_thread(self._thread.join, self._stall_timeout_s)

    # -- engine thread --------------------------------------------------------------------------

    def _start_engine(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name="transformers-engine", daemon=True
            )
            self._thread.start()

    def _run(self) -> None:
        while True:
            commands = self._take_commands()
            for command in commands:
                if isinstance(command, _WeightUpdate):
                    self._apply_weight_update(command)
                elif isinstance(command, _AdapterUpdate):
                    self._apply_adapter_update(command)
                elif isinstance(command, _Hold):
                    self._apply_hold(command)
                elif command is not _CLOSE:
                    self._waiting.append(command)
            if _CLOSE in commands:
                self._abort_everything()
                return
            if self._holds:
                continue  # held: no forward pass until the last hold is released
            try:
                self._step()
            except Exception as error:  # noqa: BLE001 -- a failed forward fails its callers, not the engine
                self._fail_everything(error)

    def _take_commands(self) -> list:
        """Everything in the inbox. When idle, block for the first command (polling so a closed
        backend is noticed), then keep collecting until the inbox stays empty for a batch window
        or BATCH_WINDOW_LIMIT windows have passed."""
        commands = []
        if self._holds or (not self._rows and not self._waiting):
            while not commands:
                try:
                    commands.append(self._inbox.get(timeout=1.0))
                except queue.Empty:
                    if self._closed:
                        return [_CLOSE]
            limit = time.monotonic() + BATCH_WINDOW_LIMIT * self._batch_window_s
            while (remaining := limit - time.monotonic()) > 0:
                try:
                    commands.append(self._inbox.get(timeout=min(remaining, self._batch_window_s)))
                except queue.Empty:
                    break
        while True:
            try:
                commands.append(self._inbox.get_nowait())
            except queue.Empty:
                return commands

    def _apply_weight_update(self, update: _WeightUpdate) -> None:
        try:
            with self._engine_lock, torch.no_grad():
                # claimed under the lock: from here on the caller waits for the copy to end
                if not update.done.set_running_or_notify_cancel():
                    return  # its caller gave up waiting: never applied
                for name, tensor in update.tensors.items():
                    self._parameters[name].copy_(tensor)
                self._version = update.version
            for row in self._rows:
                if not row.job.adapter:  # adapter samples' spans track their adapter's versions
                    row.version_marks.append((len(row.tokens), update.version))
        except Exception as error:  # noqa: BLE001 -- handed to the caller awaiting the update
            update.done.set_exception(error)
        else:
            update.done.set_result(None)

    def _apply_adapter_update(self, update: _AdapterUpdate) -> None:
        weights = update.weights
        try:
            with self._engine_lock:
                # claimed under the lock, as a full-weight update is
                if not update.done.set_running_or_notify_cancel():
                    return  # its caller gave up waiting: never applied
                # checked again: another update may have been applied since the caller checked
                self._lora.check_room(weights.spec, weights.version)
                self._lora.install(weights)
            for row in self._rows:
                if row.job.adapter == weights.spec.name:
                    row.version_marks.append((len(row.tokens), weights.version))
        except Exception as error:  # noqa: BLE001 -- handed to the caller awaiting the update
            update.done.set_exception(error)
        else:
            update.done.set_result(None)

    def _apply_hold(self, command: _Hold) -> None:
        """Between two decode steps (so no forward pass is running): count the hold in or out."""
        if not command.done.set_running_or_notify_cancel():
            return
        self._holds = max(0, self._holds + (1 if command.opens else -1))
        frozen = len({id(row.job) for row in self._rows} | {id(job) for job in self._waiting})
        command.done.set_result((time.time(), frozen))

    def _decode_routing(self) -> Routing | None:
        """The adapter routing of the running rows, rebuilt only when the rows or the adapters
        changed (every change assigns a new `self._rows` list or a new held mapping)."""
        key = (self._rows, self._lora.held)
        if self._routing_key is None or self._routing_key[0] is not key[0] or self._routing_key[1] is not key[1]:
            self._routing = self._lora.routing([row.job.adapter for row in self._rows])
            self._routing_key = key
        return self._routing

    def _step(self) -> None:
        """One decode step for the running rows, plus the prefill of waiting jobs that fit."""
        self._drop_cancelled_rows()
        joining = self._admit_waiting_jobs()
        if not self._rows and not joining:
            return
        with self._engine_lock:
            logits = []
            if self._batch is not None:
                with self._lora.applied(self._decode_routing()):
                    logits.append(self._batch.decode(self._model, self._next_tokens))
            if joining:
                with self._lora.applied(self._lora.routing([job.adapter for job in joining])):
                    new_batch, new_logits = DecodeBatch.prefill(
                        self._model, [job.prompt for job in joining], self._pad_id
                    )
                # the n samples of a job share its prompt's prefill: repeat its cache rows n times
                samples = torch.tensor([job.sampling.n for job in joining])
                repeat = torch.arange(len(joining)).repeat_interleave(samples)
                new_batch.select(repeat)
                logits.append(new_logits[repeat.to(new_logits.device)])
                if self._batch is None:
                    self._batch = new_batch
                else:
                    self._batch.merge(new_batch)
                self._rows = self._rows + [row for job in joining for row in self._new_rows(job)]
                self._prefilling = []
            all_logits = logits[0] if len(logits) == 1 else torch.cat(logits)
            temperature, top_p, top_k = self._sampling_tensors(all_logits.device)
            # one draw per sampled row from its own stream; greedy rows never use theirs
            uniforms = torch.tensor(
                [row.rng.random() if row.sampled else 0.0 for row in self._rows],
                dtype=torch.float64,
            )
            tokens, logprobs = sample_next_tokens(all_logits, temperature, top_p, uniforms, top_k)
        self._consume(tokens, logprobs.tolist(), tokens.tolist())

    def _sampling_tensors(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per-row temperature, top_p and top_k, rebuilt only when the rows changed (every change
        assigns a new `self._rows` list)."""
        if self._sampling_rows is not self._rows:
            temperature = torch.tensor([row.job.sampling.temperature for row in self._rows])
            top_p = torch.tensor([row.job.sampling.top_p for row in self._rows])
            top_k = torch.tensor([row.job.sampling.top_k for row in self._rows], dtype=torch.long)
            self._sampling = (temperature.to(device), top_p.to(device), top_k.to(device))
            self._sampling_rows = self._rows
        return self._sampling

    def _admit_waiting_jobs(self) -> list[_Job]:
        """Waiting jobs whose samples fit in the batch, in arrival order."""
        joining, room = [], self._max_batch_rows - len(self._rows)
        while self._waiting and (
            self._waiting[0].sampling.n <= room or not (self._rows or joining)
        ):
            job = self._waiting.pop(0)
            if job.cancelled:
                continue
            joining.append(job)
            room -= job.sampling.n
        self._prefilling = joining
        return joining

    def _new_rows(self, job: _Job) -> list[_Row]:
        version = self._lora.version(job.adapter) if job.adapter else self._version
        seed = job.sampling.seed if job.sampling.seed is not None else secrets.randbits(63)
        return [
            # each sample's own stream: the same (seed, index) draws the same numbers in any batch
            _Row(job, index, random.Random(f"{seed}:{index}"), [(0, version)])
            for index in range(job.sampling.n)
        ]

    def _consume(self, tokens: torch.Tensor, logprobs: list[float], token_list: list[int]) -> None:
        """Append each row's token, finish rows that are done, stream deltas, shrink the batch."""
        outbox: dict[asyncio.AbstractEventLoop, list] = defaultdict(list)
        keep = []
        for index, (row, token, logprob) in enumerate(zip(self._rows, token_list, logprobs)):
            row.tokens.append(token)
            row.logprobs.append(logprob)
            finish, text = self._finish_reason(row, token)
            if finish is None:
                keep.append(index)
                if len(row.tokens) - row.sent_tokens >= self._stream_interval:
                    self._stream(row, outbox)
            else:
                self._finish(row, finish, text, outbox)
        for loop, events in outbox.items():
            loop.call_soon_threadsafe(_deliver, events)
        if len(keep) < len(self._rows):
            self._rows = [self._rows[index] for index in keep]
            if keep:
                kept = torch.tensor(keep)
                self._batch.select(kept)
                tokens = tokens[kept.to(tokens.device)]
            else:
                self._batch = None
        self._next_tokens = tokens

    def _finish_reason(self, row: _Row, token: int) -> tuple[FinishReason | None, str | None]:
        """Why the row is done after `token` (None if it is not), and its final text if known."""
        if token in self._stop_ids:
            return FinishReason.STOP, None
        stops = row.job.sampling.stop
        if stops:
            self._detokenize(row, len(row.tokens))
            longest = max(map(len, stops))
            window_start = max(0, row.stop_checked_chars - longest + 1)
            hits = [found for stop in stops if (found := row.text.find(stop, window_start)) >= 0]
            row.stop_checked_chars = len(row.text)
            if hits:
                return FinishReason.STOP, row.text[: min(hits)]
        if len(row.tokens) >= row.job.max_new_tokens:
            return FinishReason.LENGTH, None
        return None, None

    def _detokenize(self, row: _Row, end: int) -> None:
        """Extend row.text with tokens[read_offset:end], holding back a trailing partial UTF-8
        character until the token that completes it arrives."""
        decode = self._tokenizer.decode
        before = decode(row.tokens[row.prefix_offset : row.read_offset])
        after = decode(row.tokens[row.prefix_offset : end])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            row.text += after[len(before) :]
            row.prefix_offset, row.read_offset = row.read_offset, end

    def _stream(self, row: _Row, outbox: dict) -> None:
        self._detokenize(row, len(row.tokens))
        # text that may still turn out to be the start of a stop string is held back
        held = max(map(len, row.job.sampling.stop), default=1) - 1
        visible = max(row.sent_chars, len(row.text) - held)
        self._send_delta(row, row.text[row.sent_chars : visible], outbox)
        row.sent_chars = visible

    def _send_delta(self, row: _Row, text: str, outbox: dict) -> None:
        delta = TokenDelta(
            row.sample_index, row.tokens[row.sent_tokens :], text, row.logprobs[row.sent_tokens :]
        )
        row.sent_tokens = len(row.tokens)
        if delta.token_ids or delta.text:
            outbox[row.job.loop].append((row.job.events, delta))

    def _finish(self, row: _Row, reason: FinishReason, text: str | None, outbox: dict) -> None:
        if text is None:
            ends_with_stop_token = reason is FinishReason.STOP
            text_tokens = row.tokens[:-1] if ends_with_stop_token else row.tokens
            text = self._tokenizer.decode(text_tokens)
        self._send_delta(row, text[row.sent_chars :], outbox)
        outbox[row.job.loop].append((row.job.events, self._result(row, reason, text)))

    def _result(self, row: _Row, reason: FinishReason, text: str) -> SampleResult:
        parsed = parse_completion(text)
        return SampleResult(
            sample_index=row.sample_index,
            prompt_token_ids=row.job.prompt,
            completion_token_ids=row.tokens,
            logprobs=row.logprobs,
            finish_reason=reason,
            text=text,
            content=parsed.content,
            tool_calls=parsed.tool_calls,
            malformed=parsed.malformed,
            version_spans=_version_spans(row.version_marks, len(row.tokens)),
        )

    def _drop_cancelled_rows(self) -> None:
        if not any(row.job.cancelled for row in self._rows):
            return
        keep = [index for index, row in enumerate(self._rows) if not row.job.cancelled]
        if len(keep) == len(self._rows):
            return
        self._rows = [self._rows[index] for index in keep]
        if keep:
            self._batch.select(torch.tensor(keep))
            self._next_tokens = self._next_tokens[
                torch.tensor(keep, device=self._next_tokens.device)
            ]
        else:
            self._batch, self._next_tokens = None, None

    def _abort_everything(self) -> None:
        outbox: dict[asyncio.AbstractEventLoop, list] = defaultdict(list)
        for row in self._rows:
            text = self._tokenizer.decode(row.tokens)
            outbox[row.job.loop].append(
                (row.job.events, self._result(row, FinishReason.ABORT, text))
            )
        for job in self._waiting:
            error = RuntimeError("backend closed before the request started")
            outbox[job.loop].append((job.events, error))
        self._rows, self._waiting, self._batch = [], [], None
        for loop, events in outbox.items():
            loop.call_soon_threadsafe(_deliver, events)

    def _fail_everything(self, error: Exception) -> None:
        failed = [row.job for row in self._rows] + self._prefilling + self._waiting
        jobs = {id(job): job for job in failed}
        for job in jobs.values():
            job.loop.call_soon_threadsafe(_deliver, [(job.events, error)])
        self._rows, self._prefilling, self._waiting = [], [], []
        self._batch, self._next_tokens = None, None


def build_backend(config: PolicyServerConfig) -> TransformersBackend:
    """The `transformers` plug-in's factory (policy_server.backends.registry): the configured model,
    loaded in-process, served from its `transformers:` section."""
    options = config.transformers
    loaded = load_model(config.model, getattr(torch, config.dtype), config.seed, options.device)
    return TransformersBackend(loaded, batch_window_s=options.batch_window_s, max_batch_rows=options.max_batch_rows,
                               stream_interval=options.stream_interval, collective=config.weights.collective,
                               max_adapters=config.adapters.held("transformers"),
                               max_adapter_rank=config.adapters.max_rank)


def _deliver(events: list[tuple[asyncio.Queue, object]]) -> None:
    for target, event in events:
        target.put_nowait(event)


def _version_spans(marks: list[tuple[int, int]], length: int) -> list[VersionSpan]:
    """[(start, version), ...] -> non-empty spans covering tokens [0, length)."""
    ends = [start for start, _ in marks[1:]] + [length]
    return [
        VersionSpan(start, end, version)
        for (start, version), end in zip(marks, ends)
        if end > start
    ]
