"""The rank's loss (spark_estimators/torch/losses.py): one output of weight 1 takes no product.

``x * 1.0`` is ``x`` bit for bit and so is its gradient, so the fit's loss skips that op (one
autograd node fewer per step, issue 45); these tests pin that the loss and every gradient are
those of the old path (``loss * 1.0``) and that weighted losses still get their weights.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from spark_estimators.torch import losses  # noqa: E402


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))


def _grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("loss_weights", [None, [1.0]])
def test_one_output_of_weight_one_is_the_loss_itself_bit_for_bit(loss_weights: object) -> None:
    x, y = torch.rand(32, 8), torch.rand(32)
    model = _model()
    outputs, labels = losses.transform_outputs(model(x), [y])
    loss = losses.LossFn([torch.nn.MSELoss()], loss_weights, weighted=False)(outputs, labels)
    loss.backward()
    ours = _grads(model)
    # no product node: the loss is the MSE's own output (the old path's grad_fn was MulBackward0)
    assert type(loss.grad_fn).__name__ == "MseLossBackward0"

    reference = _model()
    out = reference(x)
    old = torch.nn.functional.mse_loss(out, y.reshape(out.shape)) * 1.0
    old.backward()
    assert torch.equal(loss.detach(), old.detach())
    for a, b in zip(ours, _grads(reference), strict=True):
        assert torch.equal(a, b)


def test_sample_weighted_loss_of_weight_one_is_unchanged() -> None:
    x, y, w = torch.rand(32, 8), torch.rand(32), torch.rand(32)
    out = _model()(x)
    loss = losses.LossFn([torch.nn.MSELoss()], None, weighted=True)([out], [y], w)
    per_row = ((out - y.reshape(out.shape)) ** 2).reshape(32, -1).mean(dim=1)
    assert torch.equal(loss.detach(), (per_row * w).mean().detach() * 1.0)


def test_weighted_outputs_still_get_their_weights() -> None:
    x, y1, y2 = torch.rand(32, 8), torch.rand(32), torch.rand(32)
    o1, o2 = _model()(x), _model()(x) * 2.0
    fn = losses.LossFn([torch.nn.MSELoss(), torch.nn.L1Loss()], [0.25, 0.75], weighted=False)
    loss = fn([o1, o2], [y1, y2])
    l1 = torch.nn.functional.mse_loss(o1, y1.reshape(o1.shape))
    l2 = torch.nn.functional.l1_loss(o2, y2.reshape(o2.shape))
    assert torch.equal(loss.detach(), (l1 * 0.25 + l2 * 0.75).detach())
    # the default weights of two outputs are 1/2 each, not skipped
    half = losses.LossFn([torch.nn.MSELoss(), torch.nn.MSELoss()], None, weighted=False)
    both = half([o1, o1], [y1, y1])
    assert torch.equal(both.detach(), (l1 * 0.5 + l1 * 0.5).detach())
