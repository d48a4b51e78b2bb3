"""engine.models.base.top_predictions: the softmax and top-k every built-in and user model answers
with, in numpy, held against torch's."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.models.base import top_predictions


@pytest.mark.parametrize(("classes", "k"), [(1000, 5), (12, 5), (3, 5), (2, 1)])
def test_the_classes_and_scores_are_torchs(classes: int, k: int) -> None:
    rng = np.random.default_rng(classes)
    logits = (rng.standard_normal((6, classes)) * 4).astype(np.float32)
    names = [f"class{i}" for i in range(classes)]
    answers = top_predictions(logits, names, k)
    probs = torch.softmax(torch.from_numpy(logits), dim=1)
    top = torch.topk(probs, min(k, classes), dim=1)
    assert len(answers) == 6
    for answer, indices, values in zip(answers, top.indices.tolist(), top.values.tolist(), strict=True):
        assert [name for name, _ in answer.labels] == [names[i] for i in indices]
        assert all(isinstance(score, float) for _, score in answer.labels)
        assert np.allclose([score for _, score in answer.labels], values, rtol=0, atol=1e-6)


def test_ties_go_to_the_class_listed_first_and_scores_sum_to_one() -> None:
    logits = np.array([[1.0, 3.0, 3.0, 0.0, 3.0]], dtype=np.float32)
    (answer,) = top_predictions(logits, ["a", "b", "c", "d", "e"], 4)
    assert [name for name, _ in answer.labels] == ["b", "c", "e", "a"]
    full = top_predictions(logits, ["a", "b", "c", "d", "e"], 5)[0]
    assert abs(sum(score for _, score in full.labels) - 1.0) < 1e-6


def test_large_logits_do_not_overflow() -> None:
    logits = np.array([[1000.0, 999.0, -1000.0]], dtype=np.float32)
    (answer,) = top_predictions(logits, ["x", "y", "z"], 3)
    scores = [score for _, score in answer.labels]
    assert all(np.isfinite(scores)) and scores[0] == pytest.approx(1 / (1 + np.exp(-1.0)), abs=1e-6)
