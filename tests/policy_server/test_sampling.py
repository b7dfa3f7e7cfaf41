import torch

from policy_server.backends.sampling import sample_next_tokens


def _draw(logits, temperature, top_p, draws=4000, seed=0):
    generator = torch.Generator().manual_seed(seed)
    batch = logits.expand(draws, -1)
    uniforms = torch.rand(draws, generator=generator, dtype=torch.float64)
    return sample_next_tokens(
        batch, torch.full((draws,), temperature), torch.full((draws,), top_p), uniforms
    )


def test_processed_logprobs_follow_temperature_and_top_p():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, -3.0]])
    temperature, top_p = 0.7, 0.8
    tokens, logprobs = _draw(logits, temperature, top_p)
    # expected: softmax(logits / T), keep the smallest top set reaching mass top_p, renormalise
    q = torch.softmax(logits[0] / temperature, dim=-1)
    keep = (q.cumsum(0) - q) < top_p  # logits are already sorted
    p = torch.where(keep, q, torch.zeros_like(q)) / q[keep].sum()
    assert torch.allclose(logprobs, p.log()[tokens], atol=1e-6)
    assert set(tokens.tolist()) == set(torch.nonzero(keep).flatten().tolist())
    frequencies = torch.bincount(tokens, minlength=5).double() / len(tokens)
    assert torch.allclose(frequencies, p.double(), atol=0.03)


def test_temperature_one_top_p_one_gives_raw_logprobs():
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(1))
    tokens, logprobs = _draw(logits, 1.0, 1.0, draws=500)
    assert torch.allclose(logprobs, torch.log_softmax(logits[0], -1)[tokens], atol=1e-6)


def test_zero_temperature_is_greedy_next_to_sampled_rows():
    logits = torch.tensor([[0.0, 3.0, 1.0], [0.0, 3.0, 1.0]])
    tokens, logprobs = sample_next_tokens(
        logits, torch.tensor([0.0, 1.0]), torch.tensor([1.0, 0.5]), torch.tensor([0.99, 0.99])
    )
    assert tokens[0] == 1 and torch.isclose(logprobs[0], torch.log_softmax(logits[0], -1)[1])
    assert tokens[1] == 1 and torch.isclose(
        logprobs[1], torch.tensor(0.0), atol=1e-6
    )  # top-p keeps only token 1


def test_all_greedy_rows_take_the_argmax_with_raw_logprobs():
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(2))
    tokens, logprobs = sample_next_tokens(
        logits, torch.zeros(5), torch.full((5,), 0.5), torch.full((5,), 0.99, dtype=torch.float64)
    )
    raw = torch.log_softmax(logits, dim=-1)
    assert torch.equal(tokens, logits.argmax(dim=-1))
    assert torch.allclose(logprobs, raw.gather(1, tokens.unsqueeze(1)).squeeze(1))


def test_top_k_then_top_p_keeps_what_vllms_sampler_keeps():
    """The kept-token rule (sciproto.sampling_rule) against vLLM's own, on rows with ties at the
    k-th logit, rows without truncation and every mix of the two settings."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    from sciproto.sampling_rule import kept_tokens

    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(12, 300, generator=generator) * 3
    logits[0, :8] = 5.0  # ties straddling k = 5
    logits[1] = logits[1].round()  # many ties
    top_k = torch.tensor([5, 20, 0, 300, 1, 40, 0, 20, 7, 0, 299, 3])
    top_p = torch.tensor([1.0, 1.0, 0.9, 0.5, 1.0, 0.95, 1.0, 0.8, 0.3, 0.99, 0.9, 1.0])
    ours = kept_tokens(logits, top_k, top_p)
    vllm_k = torch.where(top_k == 0, 300, top_k)  # vLLM's "every token" is k = vocabulary
    theirs = apply_top_k_top_p_pytorch(logits.clone(), vllm_k, top_p) > float("-inf")
    assert ours is not None and torch.equal(ours, theirs)


def test_top_k_samples_only_the_k_likeliest_and_reports_their_renormalised_logprobs():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, -3.0]])
    draws = 4000
    generator = torch.Generator().manual_seed(0)
    tokens, logprobs = sample_next_tokens(
        logits.expand(draws, -1), torch.full((draws,), 1.0), torch.ones(draws),
        torch.rand(draws, generator=generator, dtype=torch.float64), torch.full((draws,), 2))
    p = torch.softmax(logits[0, :2], dim=-1)
    assert set(tokens.tolist()) == {0, 1}
    assert torch.allclose(logprobs, p.log()[tokens], atol=1e-6)
