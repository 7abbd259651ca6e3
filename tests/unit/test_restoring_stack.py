"""A second signal while the run restores the cluster waits until every restore step has run."""

from __future__ import annotations

import os
import signal

import pytest

from pytest_gpucanary.run import RestoringStack


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_during_the_restore_is_deferred_until_every_step_ran(signum: int) -> None:
    said: list[str] = []
    steps: list[str] = []
    with pytest.raises(KeyboardInterrupt, match="deferred until the cluster was restored"):
        with RestoringStack(said.append) as stack:
            stack.callback(steps.append, "policy restored")          # runs last
            stack.callback(lambda: (os.kill(os.getpid(), signum), steps.append("pool released")))
    assert steps == ["pool released", "policy restored"]
    assert said == [f"signal {signum} deferred: restoring the cluster first (SIGKILL abandons the restore; "
                    "`gpucanary cleanup` then finishes it)"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler      # handlers put back


def test_the_first_interrupt_still_propagates_and_a_second_one_is_not_raised_over_it() -> None:
    steps: list[str] = []
    with pytest.raises(KeyboardInterrupt, match="^first$"):
        with RestoringStack(lambda line: None) as stack:
            stack.callback(lambda: (os.kill(os.getpid(), signal.SIGINT), steps.append("restored")))
            raise KeyboardInterrupt("first")
    assert steps == ["restored"]
