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


def multiprocess_cpu_backends() -> list[str]:
    """Registered transports that move CPU tensors between processes (not the codec layers
    over them: test_conformance and test_codec run those)."""
    from weightsync.transport import CheckpointEngineRegistry

    out = []
    for name in CheckpointEngineRegistry.names():
        caps = CheckpointEngineRegistry.get(name).capabilities
        if "cpu" in caps and "same_process" not in caps and "codec" not in caps \
                and not name.startswith("test"):
            out.append(name)
    return out


def on_all(handles, method, *args, **kwargs):
    """Call ``method`` on every worker handle at once (bounded); their values, or raise."""
    from weightsync.orchestration.calls import Call, call_all, values_or_raise

    return values_or_raise(call_all([Call(f"worker {i}", h, method, args, kwargs)
                                     for i, h in enumerate(handles)], timeout=120, phase=method))


def assert_clean(results: list, spec) -> None:
    """Every worker of a ``run_group`` scenario ran all steps without an error or a leftover
    thread, and every rollout rank got every tensor once, bit-exact."""
    for r in results:
        assert "fatal" not in r and "died" not in r and "hung" not in r, r
        assert not r["errors"], (r["role"], r["rank"], r["errors"])
        assert len(r["steps"]) == spec.steps
        assert not r.get("threads"), f"threads left behind: {r.get('threads')}"
    for r in results:
        if r["role"] == "rollout":
            for step in r["steps"]:
                assert not step["missing"], step["missing"][:5]
                assert not step["dupes"], step["dupes"][:5]
                assert not step["bad"], step["bad"][:5]
