"""Checks shared by the orchestration tests (rollout output vs the trainer's reference)."""

from __future__ import annotations

import torch


def same_logits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool((a.reshape(-1) == b.reshape(-1)).all())


def assert_matches(gens, ref: dict, version, *, exact: bool = True, who: str = "replica") -> None:
    """Every generation equals the reference (tokens; logits bit-exact or close) and
    carries ``version``."""
    assert len(gens) == len(ref["tokens"])
    for i, (g, tokens, logits) in enumerate(zip(gens, ref["tokens"], ref["logits"])):
        assert g.version == version, f"{who} output {i} carries version {g.version}, not {version}"
        assert not g.aborted
        assert g.tokens == tokens, f"{who} output {i}: tokens {g.tokens} != trainer's {tokens}"
        if exact:
            assert same_logits(g.logits, logits), \
                f"{who} output {i}: logits differ (max {float((g.logits - logits).abs().max()):.3e})"
        else:
            torch.testing.assert_close(g.logits, logits, rtol=1e-4, atol=1e-4)


def assert_changed(ref: dict, prev: dict | None) -> None:
    """The reference itself moved (so matching it proves the rollout is not stale)."""
    if prev is not None:
        assert any(not same_logits(a, b) for a, b in zip(ref["logits"], prev["logits"])), \
            "training did not change the model's logits; the staleness check would be vacuous"
