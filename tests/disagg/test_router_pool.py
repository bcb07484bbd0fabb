"""The router's engine choice (router/backends.py): least in-flight first with rotation among
equals, plain rotation, engines marked down skipped while others are up, exclusions."""
from dsv4.router.backends import Pool


def test_least_loaded_then_rotation():
    pool = Pool("decode", ["http://a", "http://b", "http://c"])
    a, b, c = pool.backends
    a.in_flight, b.in_flight, c.in_flight = 2, 0, 1
    assert pool.pick() is b
    b.in_flight = 5
    assert pool.pick() is c
    c.in_flight = a.in_flight = b.in_flight = 0
    assert {pool.pick().url for _ in range(3)} == {"http://a", "http://b", "http://c"}


def test_round_robin_down_and_excluded():
    pool = Pool("prefill", ["http://a", "http://b"], policy="round-robin")
    assert [pool.pick().url for _ in range(4)] == ["http://a", "http://b", "http://a", "http://b"]
    pool.backends[0].mark_down()
    assert {pool.pick().url for _ in range(4)} == {"http://b"}
    assert pool.pick(exclude={"http://b"}).url == "http://a"       # down, but the only one left
    assert pool.pick(exclude={"http://a", "http://b"}) is None
