"""learner.lora: a LoRA adapter trains on a frozen base (GRPO and SFT), is pushed alone under the
wire's names, checkpoints alone and resumes exactly, and what does not combine with it is refused
in one line."""

from __future__ import annotations

import asyncio
import json
import math
import random
from collections.abc import Mapping
from pathlib import Path

import pytest
import torch
from learner_fixtures import MEASURED, VOCAB, make_group, tiny_model, with_shared_prompt
from pydantic import ValidationError
from safetensors.torch import load_file
from test_learner_service import TrainStream, describe, learner_config, start_learner
from test_learner_service import make_group as wire_group

from learner.checkpoint import load_checkpoint, save_checkpoint
from learner.config import GRPOConfig
from learner.lora_limits import refusal
from learner.policy_sync import PolicySync
from learner.push_types import PushResult, ServingDigestMismatch, check_serving, serving_of
from learner.ranks import Ranks
from learner.server_config import LearnerServerConfig
from learner.trainer import GRPOTrainer
from learner.types import Objective, RolloutGroup, TrainSample
from sciproto.channel import make_channel
from sciproto.client.policy import PolicyClient, generate_request
from sciproto.config import ConfigError
from sciproto.lora import ADAPTER_PREFIX, LoraSpec, adapter_tensor_specs, linear_layers
from sciproto.models import load_model
from sciproto.pb import policy_pb2
from sciproto.processes import start_server
from sciproto.rundir import checkpoint_dir
from sciproto.weights.wire import set_digest, tensor_digests

SPEC = LoraSpec(name="run-a", rank=4, alpha=8.0)
CONFIG = GRPOConfig(lr=1e-2)


def _batches(seed: int = 7) -> list[list[RolloutGroup]]:
    rng = random.Random(seed)
    return [[make_group(rng, [1.0, 0.0, 0.5, 0.0], group_id=f"{n}-{g}") for g in range(2)] for n in range(3)]


def _base_weights(trainer: GRPOTrainer) -> dict[str, torch.Tensor]:
    """The frozen base's tensors, by the names they had before PEFT wrapped their linears."""
    return {name.replace(".base_layer", ""): tensor.clone() for name, tensor in trainer.model.state_dict().items()
            if ".lora_" not in name}


def _adapter(trainer: GRPOTrainer) -> dict[str, torch.Tensor]:
    return trainer.state_dict_for_push()


def _assert_equal(got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    differ = [name for name in want if not torch.equal(got[name], want[name])]
    assert not differ, f"{len(differ)} of {len(want)} tensors differ, e.g. {differ[:3]}"


def test_only_the_adapter_trains_and_it_is_pushed_under_the_wire_names() -> None:
    base = tiny_model(seed=0)
    before = {name: tensor.clone() for name, tensor in base.state_dict().items()}
    layers = linear_layers(base)
    trainer = GRPOTrainer(base, CONFIG, lora=SPEC, push_dtype=torch.bfloat16)

    wire = adapter_tensor_specs(layers, SPEC, "bfloat16")
    optimized = [p for group in trainer.optimizer.param_groups for p in group["params"]]
    assert sum(p.numel() for p in optimized) == sum(math.prod(s.shape) for s in wire) == 1792
    assert all(p.requires_grad for p in optimized)
    assert sum(p.requires_grad for p in trainer.model.parameters()) == len(wire)
    start = _adapter(trainer)
    assert not any(start[s.name].any() for s in wire if s.name.endswith("lora_B.weight"))  # B starts at 0

    metrics = trainer.train_step(_batches()[0])
    assert metrics.trained and metrics.policy_version == 1

    _assert_equal(_base_weights(trainer), before)  # bit-identical base
    pushed = trainer.state_dict_for_push()
    assert [(name, tuple(t.shape), t.dtype) for name, t in pushed.items()] == [
        (s.name, s.shape, torch.bfloat16) for s in wire]
    assert all(name.startswith(ADAPTER_PREFIX) and t.device.type == "cpu" for name, t in pushed.items())
    moved = [name for name in pushed if name.endswith("lora_B.weight") and pushed[name].any()]
    assert len(moved) == len(wire) // 2  # every B left zero
    # The pushed tensors are copies: the trainer's fp32 masters are not the pushed ones.
    pushed[wire[1].name].zero_()
    assert trainer.state_dict_for_push()[wire[1].name].any()


def test_the_kl_reference_is_the_base_with_the_adapter_switched_off() -> None:
    trainer = GRPOTrainer(tiny_model(seed=0), GRPOConfig(lr=1e-2, kl_coef=0.1), lora=SPEC)
    assert trainer.reference_model is None  # no copy of the base
    first, second = _batches()[:2]
    # B = 0: the policy is the base, so the reference gives exactly the policy's log-probs.
    assert trainer.train_step(first).kl == 0.0
    assert trainer.train_step(second).kl > 1e-6
    # and with the adapter switched off the model computes what the untouched base does.
    ids = torch.tensor([[random.Random(3).randrange(VOCAB) for _ in range(12)]])
    with torch.no_grad(), trainer.lora.base_only():
        off = trainer.model(input_ids=ids).logits
    on = trainer.model(input_ids=ids).logits.detach()
    base = tiny_model(seed=0)(input_ids=ids).logits.detach()
    assert torch.equal(off, base) and not torch.allclose(on, base)


@pytest.mark.parametrize(("precision", "tolerance"), [("fp32", 1e-5), ("bf16", 2e-2)])
def test_the_shared_prefix_cache_runs_through_the_adapter(precision: str, tolerance: float) -> None:
    """The prompt a group shares runs once, its key/value cache made by the adapter's linears: the
    same step as every sequence in full (the trainer forwards the transformers model itself)."""
    prompt = list(range(40, 60))
    batches = [[with_shared_prompt(group, prompt) for group in batch] for batch in _batches()[:2]]
    steps = {}
    for shared in (0, 8):
        config = GRPOConfig(lr=1e-2, precision=precision, shared_prefix_min_tokens=shared)
        trainer = GRPOTrainer(tiny_model(seed=0), config, lora=SPEC)
        cached_calls: list[bool] = []
        trainer.model.register_forward_pre_hook(
            lambda module, args, kwargs, calls=cached_calls: calls.append(bool(kwargs.get("use_cache"))),
            with_kwargs=True)
        steps[shared] = ([trainer.train_step(batch).loss for batch in batches], _adapter(trainer))
        assert any(cached_calls) == bool(shared)  # the prefix ran once, through the cache
    (full_losses, full), (shared_losses, cached) = steps[0], steps[8]
    assert shared_losses == pytest.approx(full_losses, rel=tolerance, abs=tolerance)
    for name in full:
        torch.testing.assert_close(cached[name], full[name], rtol=tolerance, atol=tolerance)
    assert any(full[name].any() for name in full if name.endswith("lora_B.weight"))


def test_a_lora_resume_takes_the_step_an_uninterrupted_run_takes(tmp_path: Path) -> None:
    config = GRPOConfig(lr=1e-2, mini_batches=2)
    batches = _batches()

    uninterrupted = GRPOTrainer(tiny_model(seed=0), config, lora=SPEC, model_name="tiny-a")
    uninterrupted.train_step(batches[0])
    expected = uninterrupted.train_step(batches[1])

    first = GRPOTrainer(tiny_model(seed=0), config, lora=SPEC, model_name="tiny-a")
    first.train_step(batches[0])
    saved = save_checkpoint(first, tmp_path)
    manifest = json.loads((saved / "manifest.json").read_text())
    assert manifest["lora"]["spec"]["rank"] == 4 and manifest["lora"]["base_model"] == "tiny-a"
    state = torch.load(saved / "trainer_state.pt", weights_only=True)
    # The adapter's tensors and AdamW state alone, not the base's.
    assert sorted(load_file(str(saved / "model.safetensors"))) == sorted(_adapter(first))
    assert len(state["optimizer"]["state"]) == len(_adapter(first))

    # Another seed draws another A: the adapter must come from the checkpoint.
    resumed = GRPOTrainer(tiny_model(seed=0), config.model_copy(update={"seed": 5}), lora=SPEC)
    assert not torch.equal(next(iter(_adapter(resumed).values())), next(iter(_adapter(first).values())))
    load_checkpoint(resumed, saved)
    assert (resumed.step, resumed.policy_version) == (1, 1)
    got = resumed.train_step(batches[1])

    assert got.model_dump(exclude=MEASURED) == expected.model_dump(exclude=MEASURED)
    _assert_equal(_adapter(resumed), _adapter(uninterrupted))


def test_a_resume_into_another_adapter_or_base_is_refused_in_one_line(tmp_path: Path) -> None:
    trainer = GRPOTrainer(tiny_model(seed=0), CONFIG, lora=SPEC, model_name="tiny-qwen2-seed0")
    trainer.train_step(_batches()[0])
    saved = save_checkpoint(trainer, tmp_path)
    full = save_checkpoint(GRPOTrainer(tiny_model(seed=0), CONFIG), tmp_path / "full")

    refusals = [
        (GRPOTrainer(tiny_model(seed=0), CONFIG, lora=SPEC.model_copy(update={"rank": 8})), saved,
         r"another spec: rank 4 \(config: 8\)"),
        (GRPOTrainer(tiny_model(seed=1), CONFIG, lora=SPEC, model_name="tiny-qwen2-seed1"), saved,
         r"base 'tiny-qwen2-seed0' .* not of this learner's 'tiny-qwen2-seed1'"),
        (GRPOTrainer(tiny_model(seed=0), CONFIG), saved, "holds LoRA adapter 'run-a', not full weights"),
        (GRPOTrainer(tiny_model(seed=0), CONFIG, lora=SPEC), full, "holds full weights, not a LoRA adapter"),
    ]
    for other, path, message in refusals:
        with pytest.raises(ConfigError, match=message) as refused:
            load_checkpoint(other, path)
        assert "\n" not in str(refused.value)
        assert other.step == 0


def test_an_sft_step_trains_the_adapter_alone() -> None:
    rng = random.Random(0)
    mask = [0] * 5 + [1] * 9
    groups = [RolloutGroup(group_id=f"demo/{n}", task="t", objective=Objective.SFT, samples=[
        TrainSample(token_ids=[rng.randrange(VOCAB) for _ in mask], loss_mask=mask, rollout_logprobs=[0.0] * 14,
                    policy_versions=[0 if m else -1 for m in mask], reward=1.0)]) for n in range(2)]
    trainer = GRPOTrainer(tiny_model(seed=0), GRPOConfig(lr=1e-2, sft_lr=3e-2), lora=SPEC)
    before = _base_weights(trainer)
    losses = [trainer.train_step(groups) for _ in range(4)]
    assert all(m.trained and m.objective == "sft" for m in losses)
    assert losses[-1].sft_loss < losses[0].sft_loss - 0.05, [m.sft_loss for m in losses]
    _assert_equal(_base_weights(trainer), before)
    assert trainer.policy_version == 4


def test_a_failed_lora_step_restores_the_adapter_and_its_adam_state() -> None:
    config = GRPOConfig(lr=1e-2, mini_batches=2)
    first, second = _batches()[:2]
    failed = GRPOTrainer(tiny_model(seed=0), config, lora=SPEC)
    untouched = GRPOTrainer(tiny_model(seed=0), config, lora=SPEC)
    failed.train_step(first), untouched.train_step(first)

    original, calls = failed.optimizer.step, []

    def step(*args: object, **kwargs: object) -> object:
        calls.append(1)
        if len(calls) == 2:  # the first mini-batch's step went through
            raise RuntimeError("the second optimizer step failed")
        return original(*args, **kwargs)

    failed.optimizer.step = step  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="second optimizer step"):
        failed.train_step(second)
    failed.optimizer.step = original  # type: ignore[method-assign]
    _assert_equal(_adapter(failed), _adapter(untouched))
    for a, b in zip(failed.optimizer.state.values(), untouched.optimizer.state.values(), strict=True):
        assert all(torch.equal(a[k], b[k]) for k in b)
    retried, once = failed.train_step(second), untouched.train_step(second)
    assert retried.model_dump(exclude=MEASURED) == once.model_dump(exclude=MEASURED)
    _assert_equal(_adapter(failed), _adapter(untouched))


@pytest.mark.parametrize(("settings", "words"), [
    ({"grpo": {"precision": "fp8"}}, "learner.lora with grpo.precision fp8: "),
    ({"grpo": {"precision": "fp8-emulated"}}, "learner.lora with grpo.precision fp8-emulated: "),
    ({"push_transport": "nccl"}, "learner.lora with push_transport nccl: "),
    ({"push_transport": "gloo"}, "learner.lora with push_transport gloo: "),
])
def test_what_does_not_combine_with_lora_is_refused_in_one_line(settings: dict, words: str) -> None:
    LearnerServerConfig.model_validate(settings)  # fine without an adapter
    with pytest.raises(ValidationError) as refused:
        LearnerServerConfig.model_validate({**settings, "lora": {"rank": 8}})
    (error,) = refused.value.errors()
    assert words in error["msg"] and "\n" not in error["msg"]


def test_fsdp2_and_fp8_trainers_refuse_an_adapter() -> None:
    assert LearnerServerConfig.model_validate({"lora": {"rank": 8}}).lora == LoraSpec(rank=8)
    line = refusal(SPEC, world_size=2)
    assert line is not None and "on 2 learner ranks" in line and "FSDP2" in line
    with pytest.raises(ConfigError, match="precision fp8-emulated"):
        GRPOTrainer(tiny_model(), GRPOConfig(precision="fp8-emulated"), lora=SPEC)


def _describe(adapters: list[tuple[str, int, bytes]], **extra: object) -> policy_pb2.PolicyServiceDescribeResponse:
    return policy_pb2.PolicyServiceDescribeResponse(policy_version=7, weights_digest=b"base", max_adapters=4, adapters=[
        policy_pb2.AdapterServing(adapter=policy_pb2.LoraAdapter(name=name, rank=4), policy_version=version,
                                  weights_digest=digest) for name, version, digest in adapters], **extra)


def test_the_learner_reads_its_adapters_version_and_digest_not_the_bases() -> None:
    tensors = {"a": torch.ones(3), "b": torch.zeros(2)}
    digests = tensor_digests(tensors)
    described = _describe([("other", 9, b"x"), ("run-a", 3, set_digest(digests))])
    assert serving_of(described) == (7, b"base")
    assert serving_of(described, "run-a") == (3, set_digest(digests))
    assert serving_of(described, "run-b") == (-1, b"")  # not loaded yet: pushed
    check_serving("p:1", described, list(tensors), digests, "run-a")
    with pytest.raises(ServingDigestMismatch, match="serves LoRA adapter 'other' version 9 with weights digest 78"):
        check_serving("p:1", described, list(tensors), digests, "other")
    with pytest.raises(ServingDigestMismatch, match="lists no LoRA adapter 'run-b'"):
        check_serving("p:1", described, list(tensors), digests, "run-b")


class _Pusher:
    """A pusher whose servers report `versions` of the adapter; records each push."""

    def __init__(self, versions: list[int]) -> None:
        self.versions = versions
        self.pushes: list[tuple[list[str], int]] = []

    async def serving_versions(self) -> list[int]:
        return self.versions

    async def push(self, state_dict: Mapping[str, torch.Tensor], version: int) -> PushResult:
        self.pushes.append((list(state_dict), version))
        return PushResult(policy_version=version, seconds=0.0, servers=len(self.versions))

    async def aclose(self) -> None: ...


@pytest.mark.parametrize(("lora", "versions", "pushed"), [
    (SPEC, [-1, -1], 0),  # no server holds the adapter: version 0 before any step
    (SPEC, [0, -1], 1),  # one holds an adapter of its name (another run's): above it
    (SPEC, [0, 0], 1),  # all do: pushed all the same, as theirs may be other weights
    (None, [0, 0], None),  # full weights the servers started with: nothing to push
])
def test_a_lora_learner_pushes_its_adapter_at_start(lora: LoraSpec | None, versions: list[int],
                                                    pushed: int | None) -> None:
    trainer = GRPOTrainer(tiny_model(seed=0), CONFIG, lora=lora)
    pusher = _Pusher(versions)
    config = LearnerServerConfig(lora=lora, policy_targets=["p:1", "p:2"])

    async def start() -> None:
        sync = PolicySync(config, trainer, Ranks(trainer), pusher, asyncio.Lock())  # type: ignore[arg-type]
        await sync.start(resumed=False)
        assert sync.reconcile_task is not None
        sync.reconcile_task.cancel()

    asyncio.run(start())
    if pushed is None:
        assert pusher.pushes == []
    else:
        assert pusher.pushes == [(list(_adapter(trainer)), pushed)] and trainer.policy_version == pushed


def test_a_lora_learner_trains_the_adapter_a_real_policy_server_samples(tmp_path: Path) -> None:
    """A tiny policy server (adapters on by default) and a LoRA learner, as processes: the adapter
    is there at version 0 before any step, a step pushes version 1, which the server checked to be
    the tensors the learner's checkpoint holds, and the base weights stay as they started."""
    policy = start_server(["serve", "policy", "--model", "tiny", "--port", "0"])
    try:
        run_dir = tmp_path / "run"
        learner = start_learner(learner_config(run_dir, policy, checkpoint_every=1,
                                               lora={"name": "run-a", "rank": 4, "alpha": 8.0}))
        try:
            asyncio.run(_train_one_step(policy.target, learner.target, run_dir))
        finally:
            learner.stop()
    finally:
        policy.stop()


async def _train_one_step(policy: str, learner: str, run_dir: Path) -> None:
    async with PolicyClient(policy) as client:
        (adapter,) = (await client.describe(timeout_s=30)).adapters
        assert (adapter.adapter.name, adapter.adapter.rank, adapter.policy_version) == ("run-a", 4, 0)
        sampled = await client.generate_group(generate_request(prompt_token_ids=[5, 6, 7], max_tokens=4,
                                                               adapter="run-a"))
        assert sampled.policy_version == 0
        channel = make_channel(learner)
        try:
            assert "weights.lora:run-a:r4" in (await describe(channel)).server.capabilities
            stream = TrainStream(channel)
            for n in range(2):
                await stream.send(wire_group(f"g{n}", version=0, seed=n))
            step = await stream.next("step")
            assert (step.step, step.policy_version) == (1, 1)
            await stream.close()
        finally:
            await channel.close()
        served = await client.describe(timeout_s=30)
    (adapter,) = served.adapters
    assert adapter.policy_version == 1
    assert (served.policy_version, served.weights_digest) == (0, b"")  # the base: never pushed
    saved = load_file(str(checkpoint_dir(run_dir, 1) / "model.safetensors"))
    names = [spec.name for spec in adapter_tensor_specs(linear_layers(load_model("tiny").model), SPEC, "float32")]
    assert adapter.weights_digest == set_digest(tensor_digests({name: saved[name] for name in names}))
