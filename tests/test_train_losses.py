import torch

from rlm.training.losses import perplexity_distillation_loss, supervised_retrieval_loss


def test_perplexity_distillation_is_kl_of_normalised_answer_likelihoods():
    torch.manual_seed(0)
    logits = torch.randn(3, 5, requires_grad=True)
    answer_logp = torch.randn(3, 5) * 3
    loss = perplexity_distillation_loss(logits, answer_logp)
    # Eq. 8: P_a(y|x) = P(a|y,x) / sum_y' P(a|y',x); KL(P_a || P~).
    p_a = answer_logp.exp() / answer_logp.exp().sum(-1, keepdim=True)
    log_p_ret = torch.log_softmax(logits, -1)
    expected = (p_a * (p_a.log() - log_p_ret)).sum(-1).mean()
    torch.testing.assert_close(loss, expected)
    loss.backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0


def test_distillation_is_zero_when_retriever_matches_reader_and_gives_reader_no_gradient():
    answer_logp = torch.randn(2, 4, requires_grad=True)
    loss = perplexity_distillation_loss(answer_logp.detach().clone(), answer_logp)
    assert loss.abs() < 1e-6
    assert not loss.requires_grad  # the reader's scores are a fixed target


def test_masked_slots_carry_no_mass():
    logits = torch.tensor([[1.0, 2.0, 50.0]])
    answer_logp = torch.tensor([[-1.0, -2.0, float("-inf")]])
    mask = torch.tensor([[True, True, False]])
    loss = perplexity_distillation_loss(logits, answer_logp, mask)
    unmasked = perplexity_distillation_loss(logits[:, :2], answer_logp[:, :2])
    torch.testing.assert_close(loss, unmasked)


def test_temperature_flattens_the_target():
    logits = torch.zeros(1, 3)
    answer_logp = torch.tensor([[0.0, -5.0, -10.0]])
    assert perplexity_distillation_loss(
        logits, answer_logp, temperature=100.0
    ) < perplexity_distillation_loss(logits, answer_logp)


def test_supervised_loss_is_cross_entropy_at_the_label():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 0.0]])
    labels = torch.tensor([1, 0])
    torch.testing.assert_close(
        supervised_retrieval_loss(logits, labels), torch.nn.functional.cross_entropy(logits, labels)
    )
