"""The mask fill's persistent threads (structured/fill_threads.py): each job runs exactly once, on
its thread or, when no thread has begun it, on the caller of `join`; errors reach the caller; a
settled job runs once, on the caller if no thread has begun it. Synchronised with events, no sleeps."""
from __future__ import annotations

import threading

import pytest

from dsv4.structured.fill_threads import FillThreads


@pytest.fixture
def threads():
    pool = FillThreads(2, "test-fill")
    yield pool
    pool.close()


def test_jobs_run_once_each_on_their_own_threads(threads):
    ran = []
    jobs = threads.submit([lambda k=k: ran.append((k, threading.current_thread().name)) for k in range(2)], None)
    assert [job.join() for job in jobs] == [False, False]           # none ran on the caller
    assert sorted(ran) == [(0, "test-fill-0"), (1, "test-fill-1")]
    again = threads.submit([lambda: ran.append("again")], None)     # the same threads serve the next step
    again[0].join()
    assert ran[-1] == "again" and len(ran) == 3


def test_a_job_no_thread_has_begun_runs_on_the_caller_once(threads):
    release, busy = threading.Event(), threading.Event()

    def block():
        busy.set()
        release.wait()
    first = threads.submit([block], None)            # thread 0 is held inside this job
    assert busy.wait(5)
    ran = []
    late = threads.submit([lambda: ran.append(threading.current_thread().name)], 0.0)
    assert late[0].join() is True                    # taken back: thread 0 is still busy
    assert ran == [threading.current_thread().name]
    release.set()
    first[0].join()
    threads.submit([lambda: ran.append("next")], None)[0].join()   # thread 0 passed over the claimed job
    assert ran == [threading.current_thread().name, "next"]


def test_an_error_on_a_thread_reaches_the_caller(threads):
    def fail():
        raise ValueError("bad fill")
    jobs = threads.submit([fail, lambda: None], None)
    with pytest.raises(ValueError, match="bad fill"):
        jobs[0].join()
    assert jobs[1].join() is False


def test_a_settled_job_runs_once_and_join_returns(threads):
    """settle: a job not begun runs on the caller (its state changes are not lost), one running
    is waited for; either way once, and a later join returns at once."""
    release, busy = threading.Event(), threading.Event()

    def block():
        busy.set()
        release.wait()
    first = threads.submit([block], None)
    assert busy.wait(5)
    ran = []
    late = threads.submit([lambda: ran.append(threading.current_thread().name)], 0.0)
    late[0].settle()                                 # not begun: runs here
    assert ran == [threading.current_thread().name]
    release.set()
    first[0].settle()                                # running: waited for
    assert late[0].join() is False and first[0].join() is False
    threads.submit([lambda: ran.append("next")], None)[0].join()   # thread 0 passed over the settled job
    assert ran == [threading.current_thread().name, "next"]


def test_a_settled_jobs_error_is_dropped(threads):
    def fail():
        raise ValueError("stale fill")
    jobs = threads.submit([fail], None)
    jobs[0].settle()
    assert jobs[0].join() is False


def test_a_job_counts_as_begun_once_its_first_part_has_run(threads):
    """submit's one wait covers every job's `first` part (the matchers' accept); a job taken
    back runs both parts, in order, on the caller."""
    firsts, fills = [], []
    jobs = threads.submit([lambda k=k: fills.append(k) for k in range(2)], None,
                          firsts=[lambda k=k: firsts.append(k) for k in range(2)])
    assert sorted(firsts) == [0, 1]                  # both ran before submit returned
    assert [job.join() for job in jobs] == [False, False] and sorted(fills) == [0, 1]
    release, busy = threading.Event(), threading.Event()

    def block():
        busy.set()
        release.wait()
    held = threads.submit([block], None)
    assert busy.wait(5)
    order = []
    late = threads.submit([lambda: order.append("fill")], 0.0, firsts=[lambda: order.append("accept")])
    assert late[0].join() is True and order == ["accept", "fill"]
    release.set()
    held[0].join()
