"""The watchdog: a run quiet for run.stall_timeout_s logs every thread's stack, marks its journal and exits
non-zero; a run that keeps making progress is left alone."""

import subprocess
import sys
import textwrap
import time

import pytest

from flexmarl_jax.orchestrator.journal import RunJournal
from flexmarl_jax.orchestrator.liveness import ProgressBeacon
from flexmarl_jax.orchestrator.watchdog import EXIT_STALLED, Watchdog


@pytest.mark.timeout(30)
def test_progress_keeps_the_watchdog_quiet_and_silence_triggers_it():
    beacon, fired = ProgressBeacon(), []
    source_time = [beacon.clock()]
    beacon.add_source("a decode step", lambda: source_time[0])
    watchdog = Watchdog(beacon, 0.5, lambda idle, what: fired.append((idle, what)), poll_s=0.05).start()
    for _ in range(10):  # 1 s of progress from a source only, every 0.1 s: never quiet for 0.5 s
        time.sleep(0.1)
        source_time[0] = beacon.clock()
    assert not fired
    assert watchdog.fired.wait(3)
    (idle, what), = fired
    assert idle > 0.5 and what == "a decode step"


@pytest.mark.timeout(60)
def test_a_stalled_run_logs_every_stack_marks_the_journal_and_exits_non_zero(tmp_path):
    # What run.py's watchdog hook does, in a process of its own (it ends with os._exit).
    script = textwrap.dedent(f"""
        import logging, threading
        from flexmarl_jax.orchestrator.journal import RunJournal
        from flexmarl_jax.orchestrator.liveness import ProgressBeacon
        from flexmarl_jax.orchestrator.watchdog import Watchdog, exit_now, report_stall, EXIT_STALLED

        logging.basicConfig(level=logging.INFO)
        journal = RunJournal({str(tmp_path)!r})

        def stalled(idle, what):
            report_stall(idle, what, 1.0, lambda text: journal.record_stop("stalled", iteration=7, detail=text))
            exit_now(EXIT_STALLED)

        def stuck_dispatcher():
            threading.Event().wait()

        threading.Thread(target=stuck_dispatcher, name="dispatch-solver", daemon=True).start()
        beacon = ProgressBeacon()
        beacon.beat("micro-batch of solver")
        Watchdog(beacon, 1.0, stalled, poll_s=0.1).start()
        threading.Event().wait()  # the main thread hangs too
    """)
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=50)
    assert result.returncode == EXIT_STALLED, result.stderr
    assert time.monotonic() - started < 30
    log = result.stderr
    assert "run stalled: no iteration, micro-batch or decode step made progress for 1 s" in log
    assert "the last progress was: micro-batch of solver" in log
    for thread in ("MainThread", "dispatch-solver", "watchdog"):
        assert f"--- thread {thread} (" in log, thread
    assert "in stuck_dispatcher" in log
    (stop,) = RunJournal(str(tmp_path)).stops()
    assert stop["reason"] == "stalled" and stop["iteration"] == 7 and "run.stall_timeout_s=1" in stop["detail"]


def test_a_watchdog_needs_a_positive_timeout():
    with pytest.raises(ValueError, match="stall_timeout_s=0 must be > 0"):
        Watchdog(ProgressBeacon(), 0, lambda idle, what: None)
