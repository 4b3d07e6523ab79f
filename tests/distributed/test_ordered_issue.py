"""Two processes x 4 fake CPU devices: computations on a mesh spanning both are issued in one order on both,
though the threads that ask for them finish in opposite orders; the placement check counts global devices."""

import json
import threading
import time

import pytest

from flexmarl_jax.distributed.ordered_issue import OrderedIssuer
from tests.distributed import processes


@pytest.mark.timeout(180)
def test_spanning_computations_are_right_when_threads_finish_in_opposite_orders_on_the_two_processes():
    port = processes.free_port()
    child = str(processes.REPO / "tests" / "distributed" / "ordered_child.py")
    started = processes.start(lambda index: [child, str(port), str(index), "schedule"], 2, devices_per_process=4)
    results = processes.wait_all(started, timeout=150)
    reports = []
    for code, out, err in results:
        assert code == 0, err[-3000:]
        reports.append(json.loads(out.strip().splitlines()[-1]))
    assert [r["process"] for r in reports] == [0, 1] and {r["count"] for r in reports} == {2}
    assert {r["global_devices"] for r in reports} == {8} and {r["local_devices"] for r in reports} == {4}
    # The threads reached the issuer in opposite orders, and the issuer ran the schedule's order on both.
    assert reports[0]["submitted"] == ["sum", "max"] and reports[1]["submitted"] == ["max", "sum"]
    assert reports[0]["issued"] == reports[1]["issued"] == ["sum", "max"]
    for report in reports:
        assert report["errors"] == {"sum": 0.0, "max": 0.0}
        assert report["too_many"].startswith("config.mesh needs 9 devices") and "but 8 exist" in report["too_many"]


def test_the_issuer_runs_keys_in_schedule_order_whatever_order_they_arrive_in():
    issuer = OrderedIssuer()
    issuer.expect([("solver", 0), ("verifier", 0), ("solver", 1)])
    ran = []
    futures = {}
    for key in [("solver", 1), ("verifier", 0)]:  # arrive before the first scheduled key
        futures[key] = issuer.submit(key, lambda key=key: ran.append(key) or key[1])
    time.sleep(0.05)
    assert ran == []  # nothing runs ahead of ("solver", 0)
    assert issuer.run(("solver", 0), lambda: ran.append(("solver", 0)) or 10) == 10
    assert [futures[key].result(5) for key in futures] == [1, 0]
    issuer.close()
    assert ran == issuer.issued == [("solver", 0), ("verifier", 0), ("solver", 1)]


def test_an_error_reaches_its_submitter_and_a_key_never_submitted_fails_close():
    issuer = OrderedIssuer()
    issuer.expect(["a", "b"])
    with pytest.raises(ZeroDivisionError):
        issuer.run("a", lambda: 1 / 0)
    with pytest.raises(RuntimeError, match=r"never submitted \['b'\]"):
        issuer.close(timeout=5)


@pytest.mark.timeout(30)
def test_many_threads_in_random_order_are_issued_in_schedule_order():
    import random

    keys = [(agent, batch) for batch in range(6) for agent in ("a", "b", "c")]
    issuer = OrderedIssuer()
    issuer.expect(keys)
    shuffled = random.Random(3).sample(keys, len(keys))

    def submit(key):
        time.sleep(random.Random(hash(key)).random() * 0.01)
        issuer.run(key, lambda: None)

    threads = [threading.Thread(target=submit, args=(key,)) for key in shuffled]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    issuer.close()
    assert issuer.issued == keys

