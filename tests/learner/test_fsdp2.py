"""Two FSDP2 processes (CPU, gloo) train exactly like one process on the same batches."""

from __future__ import annotations

import random
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from learner_fixtures import VOCAB, make_group, tiny_model, with_shared_prompt

from learner.checkpoint import checkpoints_dir, load_checkpoint, save_checkpoint
from learner.config import GRPOConfig
from learner.distributed import broadcast_groups, current_context
from learner.trainer import GRPOTrainer

WORLD_SIZE = 2
# Two optimizer steps per batch: the pi_old pass and both steps run their collectives in step.
CONFIG = GRPOConfig(lr=1e-2, micro_batch_tokens=40, shared_prefix_min_tokens=4, mini_batches=2)


def _batches() -> list:
    rng = random.Random(3)
    # Five groups of uneven sizes: the ranks get different numbers of sequences and micro-batches.
    # The second batch's groups share 6-token prompts: its micro-batches run them once.
    prompt = [rng.randrange(VOCAB) for _ in range(6)]
    return [
        [make_group(rng, [1.0, 0.0, 0.25][: 2 + g % 2], group_id=f"0-{g}") for g in range(5)],
        [with_shared_prompt(make_group(rng, [1.0, 0.0, 0.25][: 2 + g % 2], group_id=f"1-{g}"), prompt)
         for g in range(5)],
    ]


def _train(trainer: GRPOTrainer, batches: list) -> list[list[float]]:
    """Loss and gradient norm of each step (Adam alone would hide a wrong gradient scale)."""
    return [[m.loss, m.grad_norm] for m in map(trainer.train_step, batches)]


def _worker(rank: int, rendezvous: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=WORLD_SIZE)
    try:
        assert current_context().world_size == WORLD_SIZE
        trainer = GRPOTrainer(tiny_model(seed=0), CONFIG)
        batches = [broadcast_groups(b if rank == 0 else None) for b in _batches()]
        figures = _train(trainer, batches)
        weights = trainer.state_dict_for_push()
        save_checkpoint(trainer, out_dir)
        if rank == 0:
            torch.save({"figures": figures, "weights": weights}, Path(out_dir) / "result.pt")
        # Both ranks meet before either tears its process group down: a rank that destroys it
        # while the other still has gloo work in flight can abort that one (SIGABRT, "terminate
        # called without an active exception").
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _shares(weights: dict[str, torch.Tensor], first: str, second: str) -> bool:
    return weights[first].untyped_storage().data_ptr() == weights[second].untyped_storage().data_ptr()


def test_two_fsdp2_ranks_match_one_process(tmp_path: Path) -> None:
    rendezvous = f"file://{tmp_path / 'rendezvous'}"
    mp.spawn(_worker, args=(rendezvous, str(tmp_path)), nprocs=WORLD_SIZE, join=True)
    result = torch.load(tmp_path / "result.pt", weights_only=True)

    single = GRPOTrainer(tiny_model(seed=0), CONFIG)
    expected_figures = _train(single, _batches())
    expected_weights = single.state_dict_for_push()

    torch.testing.assert_close(result["figures"], expected_figures, rtol=1e-5, atol=1e-7)
    # Adam turns float-rounding differences of near-zero gradients into updates of up to a few
    # 1e-5 at lr 1e-2; a wrong gradient scale or a lost shard would differ by ~lr.
    assert set(result["weights"]) == set(expected_weights)
    for name, value in expected_weights.items():
        torch.testing.assert_close(result["weights"][name], value, rtol=1e-3, atol=2e-4)
    # Tied weights (the tiny model ties its embeddings to the LM head) are one tensor in a push,
    # as in one process: a push sends each tensor once, and a policy server refuses a tied name
    # sent apart (it is not a parameter of its model).
    assert _shares(expected_weights, "lm_head.weight", "model.embed_tokens.weight")
    assert _shares(result["weights"], "lm_head.weight", "model.embed_tokens.weight")

    # The checkpoint the two ranks wrote loads into a single process.
    restored = GRPOTrainer(tiny_model(seed=5), CONFIG)
    load_checkpoint(restored, max(checkpoints_dir(tmp_path).glob("step_*")))
    assert restored.policy_version == 2
    for name, value in restored.state_dict_for_push().items():
        torch.testing.assert_close(value, result["weights"][name])


BF16_CONFIG = CONFIG.model_copy(update={"precision": "bf16", "lr": 1e-6})


def _bf16_worker(rank: int, rendezvous: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=WORLD_SIZE)
    try:
        trainer = GRPOTrainer(tiny_model(seed=0), BF16_CONFIG)
        start = trainer.state_dict_for_push()
        batches = [broadcast_groups(b if rank == 0 else None) for b in _batches()]
        figures = _train(trainer, batches)
        shard_dtypes = sorted({str(p.dtype) for p in trainer.model.parameters()})
        weights = trainer.state_dict_for_push()
        if rank == 0:
            torch.save({"figures": figures, "start": start, "weights": weights, "shard_dtypes": shard_dtypes},
                       Path(out_dir) / "result.pt")
        dist.barrier()  # as in _worker: no rank tears down under the other's gloo work
    finally:
        dist.destroy_process_group()


def test_two_fsdp2_ranks_in_bf16_keep_fp32_masters(tmp_path: Path) -> None:
    """MixedPrecisionPolicy(bf16 compute, fp32 reduce) over fp32 shards: lr 1e-6 steps still move
    the weights, and loss and gradient norm stay close to one process under bf16 autocast (the two
    round differently: FSDP2 runs every op of the block in bf16, autocast keeps norms in fp32)."""
    rendezvous = f"file://{tmp_path / 'rendezvous'}"
    mp.spawn(_bf16_worker, args=(rendezvous, str(tmp_path)), nprocs=WORLD_SIZE, join=True)
    result = torch.load(tmp_path / "result.pt", weights_only=True)
    assert result["shard_dtypes"] == ["torch.float32"]
    moved = sum(int((result["weights"][n] != result["start"][n]).sum()) for n in result["start"])
    total = sum(t.numel() for t in result["start"].values())
    assert moved / total > 0.9

    single = GRPOTrainer(tiny_model(seed=0), BF16_CONFIG)
    torch.testing.assert_close(result["figures"], _train(single, _batches()), rtol=2e-2, atol=1e-3)
