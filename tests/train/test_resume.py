"""Resuming is exact: a run killed (SIGKILL) or preempted (SIGTERM) at step 10 and resumed to
step 20 logs the same fp32 losses, step for step, as a run of 20 steps straight."""

import pytest
from train_helpers import run_cli, train_losses

STEPS = 20


@pytest.fixture(scope="module")
def straight(tiny_overrides, tmp_path_factory) -> dict[int, float]:
    run_dir = tmp_path_factory.mktemp("straight")
    result = run_cli([*tiny_overrides, f"run.dir={run_dir}", f"run.steps={STEPS}",
                      "run.checkpoint_every=4"])
    assert result.returncode == 0, result.stderr
    losses = train_losses(run_dir)
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert losses[STEPS] < losses[1] - 0.5  # it learns
    return losses


@pytest.mark.parametrize("sig,returncode", [("SIGKILL", -9), ("SIGTERM", 0)])
def test_resume_after_signal_is_exact(straight, tiny_overrides, tmp_path, sig, returncode):
    common = [*tiny_overrides, f"run.dir={tmp_path}", f"run.steps={STEPS}",
              "run.checkpoint_every=4"]
    first = run_cli([*common, "run.debug_signal_step=10", f"run.debug_signal={sig}"])
    assert first.returncode == returncode, first.stderr
    if sig == "SIGTERM":  # a clean stop saves the step it stopped at
        assert "stopped by a signal at step 10" in first.stdout + first.stderr
        assert (tmp_path / "checkpoints" / "10").is_dir()
    assert max(train_losses(tmp_path)) == 10
    second = run_cli(common)
    assert second.returncode == 0, second.stderr
    output = second.stdout + second.stderr
    resumed_from = int(output.split("from step ")[1].split()[0])
    assert resumed_from == 10 if sig == "SIGTERM" else 4 <= resumed_from <= 10
    assert train_losses(tmp_path) == straight  # every step, bit for bit
