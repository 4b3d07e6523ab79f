"""StopSignals: the first signal asks for a stop (finish or abandon the iteration), a second abandons, and a
stop that takes longer than its timeout is ended by the timer."""

import signal
import threading

import pytest

from flexmarl_jax.orchestrator.stop_signals import StopSignals


def _signals(mode, timeout_s=60.0):
    abandoned, overdue = [], threading.Event()
    signals = StopSignals(mode, timeout_s, abandon=lambda: abandoned.append(1),
                          on_timeout=lambda detail: overdue.set())
    return signals, abandoned, overdue


def test_finish_waits_for_the_iteration_and_a_second_signal_abandons_it():
    signals, abandoned, _ = _signals("finish")
    signals.request(signal.SIGTERM)
    assert signals.requested.is_set() and abandoned == [] and signals.exit_code == 128 + signal.SIGTERM
    signals.request(signal.SIGINT)
    signals.request(signal.SIGINT)
    assert abandoned == [1] and signals.signal_name == "SIGTERM"  # abandoned once; the first signal names it
    signals.restore()


def test_abandon_mode_gives_the_iteration_up_at_the_first_signal():
    signals, abandoned, _ = _signals("abandon")
    signals.request(signal.SIGINT)
    assert abandoned == [1] and signals.exit_code == 128 + signal.SIGINT
    signals.restore()


@pytest.mark.timeout(20)
def test_a_stop_that_takes_too_long_is_ended_by_the_timer():
    signals, _, overdue = _signals("finish", timeout_s=0.2)
    signals.request(signal.SIGTERM)
    assert overdue.wait(5)


def test_installed_handlers_are_restored():
    before = signal.getsignal(signal.SIGTERM)
    signals, _, _ = _signals("finish")
    signals.install()
    assert signal.getsignal(signal.SIGTERM) == signals._handle
    signals.restore()
    assert signal.getsignal(signal.SIGTERM) == before
    with pytest.raises(ValueError, match="stop mode 'later'; allowed: finish, abandon"):
        StopSignals("later", 1.0, abandon=lambda: None, on_timeout=lambda detail: None)
