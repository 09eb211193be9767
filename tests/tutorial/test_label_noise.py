import pytest
import torch

from pergrad_viz.tutorial.label_noise import flip_labels, precision_at_k, random_precision, train
from pergrad_viz.tutorial.networks import MLP


def test_flip_labels_flips_exactly_the_fraction_to_other_classes():
    labels = torch.arange(200) % 10
    noisy, flipped = flip_labels(labels, 0.05, 10, seed=3)
    assert flipped.sum().item() == 10
    assert torch.all(noisy[flipped] != labels[flipped])
    assert torch.equal(noisy[~flipped], labels[~flipped])
    assert noisy.min() >= 0 and noisy.max() <= 9
    again, flipped_again = flip_labels(labels, 0.05, 10, seed=3)
    assert torch.equal(again, noisy) and torch.equal(flipped_again, flipped)
    _, other = flip_labels(labels, 0.05, 10, seed=4)
    assert not torch.equal(other, flipped)


@pytest.mark.parametrize("fraction,n_classes,match", [(1.5, 10, "between 0 and 1"), (0.1, 1, "at least 2")])
def test_flip_labels_errors(fraction, n_classes, match):
    with pytest.raises(ValueError, match=match):
        flip_labels(torch.zeros(10, dtype=torch.long), fraction, n_classes)


def test_precision_at_k():
    scores = torch.tensor([0.9, 0.1, 0.8, 0.3, 0.7])
    relevant = torch.tensor([True, False, False, False, True])
    assert precision_at_k(scores, relevant, 1) == 1.0
    assert precision_at_k(scores, relevant, 2) == 0.5
    assert precision_at_k(scores, relevant, 3) == pytest.approx(2 / 3)
    assert random_precision(relevant) == pytest.approx(0.4)
    with pytest.raises(ValueError, match="k must be"):
        precision_at_k(scores, relevant, 0)


def test_train_lowers_the_loss_and_is_seeded():
    torch.manual_seed(0)
    x, y = torch.randn(128, 784), torch.randint(0, 10, (128,))
    torch.manual_seed(1)
    a = MLP(784, 8, 10)
    torch.manual_seed(1)
    b = MLP(784, 8, 10)
    history = train(a, x, y, epochs=5, seed=2)
    assert history[-1] < history[0]
    assert history == train(b, x, y, epochs=5, seed=2)
    assert not a.training
