"""Corrector network: identity at init, the two losses of the paper, save/load."""

from __future__ import annotations

import pytest
import torch

from rlm.retriever.corrector import CorrectorNetwork, corrector_ce_loss, corrector_mse_loss


@pytest.mark.learning
def test_identity_at_init_and_trainable():
    torch.manual_seed(0)
    net = CorrectorNetwork(16, 64, num_hidden_layers=2)
    x = torch.randn(5, 3, 16)
    torch.testing.assert_close(net(x), x, atol=0, rtol=0)
    assert len(net.hidden) == 2 and net.hidden[1].in_features == 64
    target = torch.randn(5, 3, 16)
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    before = (net(x) - target).pow(2).mean().item()
    for _ in range(50):
        opt.zero_grad()
        (net(x) - target).pow(2).mean().backward()
        opt.step()
    assert (net(x) - target).pow(2).mean().item() < before * 0.5
    assert net.hidden[0].weight.grad.abs().sum() > 0, "hidden layers must learn once the output moves"


def test_rejects_bad_sizes():
    with pytest.raises(ValueError, match="num_hidden_layers"):
        CorrectorNetwork(8, 16, num_hidden_layers=-1)
    with pytest.raises(ValueError, match="hidden_dim > 0"):
        CorrectorNetwork(8, 0)


def test_zero_hidden_layers_is_the_linear_residual_map(tmp_path):
    """Section 5.3's smallest corrector: h(x) = x + W x + b, identity at init, saved and loaded like the rest."""
    net = CorrectorNetwork(8, 16, num_hidden_layers=0)
    assert len(net.hidden) == 0 and net.output.in_features == 8
    x = torch.randn(5, 8)
    torch.testing.assert_close(net(x), x, atol=0, rtol=0)
    with torch.no_grad():
        net.output.weight.normal_()
        net.output.bias.normal_()
    torch.testing.assert_close(net(x), x + x @ net.output.weight.T + net.output.bias)
    net.save_pretrained(tmp_path / "h0")
    loaded = CorrectorNetwork.from_pretrained(tmp_path / "h0")
    assert loaded.num_hidden_layers == 0
    torch.testing.assert_close(loaded(x), net(x))


def test_ce_loss_matches_definition_and_stops_target_gradient():
    torch.manual_seed(0)
    target = torch.randn(4, 6, requires_grad=True)
    corrected = torch.randn(4, 6, requires_grad=True)
    loss = corrector_ce_loss(target, corrected, beta=2.0)
    expected = -(torch.softmax(2 * target, -1) * torch.log_softmax(2 * corrected, -1)).sum(-1).mean()
    torch.testing.assert_close(loss, expected)
    loss.backward()
    assert target.grad is None and corrected.grad is not None
    # minimised exactly when the corrected distribution equals the target one
    same = corrector_ce_loss(target, target.detach().clone())
    shifted = corrector_ce_loss(target, target.detach() + torch.randn(4, 6))
    assert same < shifted


def test_ce_loss_mask_drops_padding():
    target = torch.tensor([[1.0, 2.0, 5.0]])
    corrected = torch.tensor([[0.5, 1.0, -9.0]])
    mask = torch.tensor([[True, True, False]])
    torch.testing.assert_close(
        corrector_ce_loss(target, corrected, mask=mask), corrector_ce_loss(target[:, :2], corrected[:, :2])
    )


def test_mse_loss_detaches_fresh():
    fresh = torch.randn(3, 8, requires_grad=True)
    corrected = torch.randn(3, 8, requires_grad=True)
    loss = corrector_mse_loss(fresh, corrected)
    torch.testing.assert_close(loss, (fresh - corrected).pow(2).sum(-1).mean())
    loss.backward()
    assert fresh.grad is None and corrected.grad is not None


def test_save_load_roundtrip(tmp_path):
    net = CorrectorNetwork(8, 32)
    with torch.no_grad():
        net.output.weight.normal_()
    net.save_pretrained(tmp_path / "h")
    again = CorrectorNetwork.from_pretrained(tmp_path / "h")
    x = torch.randn(4, 8)
    torch.testing.assert_close(again(x), net(x))
    with pytest.raises(FileNotFoundError, match="corrector_config.json"):
        CorrectorNetwork.from_pretrained(tmp_path)


@pytest.mark.learning
def test_linear_term_starts_at_identity_and_fits_a_linear_drift_the_relu_mlp_cannot(tmp_path):
    """A rotation-like drift g = M x: the linear term fits it to float precision, the ReLU MLP alone does not."""
    torch.manual_seed(0)
    dim = 8
    drift = torch.linalg.qr(torch.randn(dim, dim)).Q  # an orthogonal map: far from the identity
    x = torch.randn(512, dim)
    target = x @ drift.T

    def fit(net):
        opt = torch.optim.Adam(net.parameters(), lr=3e-2)
        for _ in range(600):
            opt.zero_grad()
            (net(x) - target).pow(2).mean().backward()
            opt.step()
        return (net(x) - target).pow(2).mean().item()

    with_linear = CorrectorNetwork(dim, dim, linear=True)
    torch.testing.assert_close(with_linear(x), x, atol=0, rtol=0)  # identity at init, as without it
    exact, approximate = fit(with_linear), fit(CorrectorNetwork(dim, dim))
    assert exact < 1e-9 and approximate > 1e4 * exact  # measured: 4.5e-12 against 6.2e-05
    with_linear.save_pretrained(tmp_path / "h")
    loaded = CorrectorNetwork.from_pretrained(tmp_path / "h")
    assert loaded.linear is not None and torch.equal(loaded(x), with_linear(x))
