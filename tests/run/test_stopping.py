"""The driver's stop signals (:mod:`agentrl.run.stopping`), in this process: SIGINT stops even when it was
inherited ignored, a checkpoint being written is finished before the stop, the shutdown is never cut."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from agentrl.run import stopping


def _signal_self(sig: int) -> None:
    os.kill(os.getpid(), sig)
    time.sleep(0.05)  # the handler runs in this (the main) thread at the next bytecode boundary


@pytest.fixture
def inherited_sigint_ignored():
    """SIGINT as ``cmd &`` in a script hands it over: ignored; put back afterwards."""
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    yield
    signal.signal(signal.SIGINT, before)
    stopping.reset()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_stop_signal_raises_even_when_sigint_was_inherited_ignored(inherited_sigint_ignored, sig, capsys):
    term_before = signal.getsignal(signal.SIGTERM)
    with stopping.handling() as installed:
        assert installed
        with pytest.raises(KeyboardInterrupt) as stopped:
            _signal_self(sig)
        assert isinstance(stopped.value, stopping.StopRequested) and stopped.value.signum == sig
        assert stopping.requested() == sig
    assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN  # the handlers found are put back
    assert signal.getsignal(signal.SIGTERM) == term_before
    assert f"{signal.Signals(sig).name} received: stopping the run" in capsys.readouterr().err


def test_a_signal_inside_a_deferred_block_stops_the_run_after_the_block(inherited_sigint_ignored, capsys):
    written = []
    with stopping.handling(), pytest.raises(stopping.StopRequested):
        with stopping.deferred():
            _signal_self(signal.SIGTERM)
            written.append("checkpoint")  # the rest of the block still runs
        written.append("after")  # never: the stop is raised as the block ends
    assert written == ["checkpoint"]
    assert "stopping once the record being written is complete" in capsys.readouterr().err


def test_signals_inside_the_shutdown_are_reported_not_raised(inherited_sigint_ignored, capsys):
    with stopping.handling():
        with stopping.shielded():
            _signal_self(signal.SIGINT)
            _signal_self(signal.SIGTERM)
            with stopping.deferred():  # a deferred block inside the shutdown does not raise either
                pass
        assert stopping.requested() == signal.SIGINT  # the first one is the one reported
    assert capsys.readouterr().err.count("already stopping") == 2


def test_handling_off_the_main_thread_installs_nothing():
    found = []
    before = signal.getsignal(signal.SIGINT)

    def worker() -> None:
        with stopping.handling() as installed:
            found.append((installed, signal.getsignal(signal.SIGINT)))

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert found == [(False, before)]
