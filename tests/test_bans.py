"""Server-side bans of peers that keep sending bad requests (pure logic)."""

from __future__ import annotations

from swarm.trust.bans import BAD_REQUEST_WINDOW, BAD_REQUESTS_BEFORE_BAN, FIRST_BAN, FORGIVE_AFTER, MAX_BAN, Bans


def offend(bans: Bans, peer: str, now: float, count: int = BAD_REQUESTS_BEFORE_BAN) -> float:
    return max(bans.record_bad_request(peer, now + i * 0.01) for i in range(count))


def test_a_few_bad_requests_are_forgiven_but_a_stream_of_them_is_banned():
    bans = Bans()
    assert offend(bans, "a", 0.0, BAD_REQUESTS_BEFORE_BAN - 1) == 0.0
    assert bans.banned_for("a", 1.0) == 0.0
    # spread over more than the window: never banned
    assert offend(bans, "a", BAD_REQUEST_WINDOW + 1, BAD_REQUESTS_BEFORE_BAN - 1) == 0.0
    assert bans.record_bad_request("a", BAD_REQUEST_WINDOW + 2) == FIRST_BAN
    assert bans.banned_for("a", BAD_REQUEST_WINDOW + 3) > 0
    assert bans.banned_for("b", BAD_REQUEST_WINDOW + 3) == 0.0  # nobody else
    assert bans.total == 1 and bans.banned_now(BAD_REQUEST_WINDOW + 3) == 1


def test_bans_grow_for_repeat_offenders_up_to_a_limit_and_are_forgiven_later():
    bans, now, lengths = Bans(), 0.0, []
    for _ in range(10):
        length = offend(bans, "a", now)
        lengths.append(length)
        now += length + 1  # the ban is over
        assert bans.banned_for("a", now) == 0.0
    assert lengths[:3] == [FIRST_BAN, 2 * FIRST_BAN, 4 * FIRST_BAN]
    assert max(lengths) == MAX_BAN
    # clean for long enough: starts over
    assert offend(bans, "a", now + FORGIVE_AFTER + 1) == FIRST_BAN


def test_requests_in_flight_when_the_ban_began_do_not_lengthen_it():
    bans = Bans()
    length = offend(bans, "a", 0.0)
    assert offend(bans, "a", 1.0, 100) == 0.0
    assert 0 < bans.banned_for("a", 1.0) <= length


def test_the_table_is_bounded(monkeypatch):
    import swarm.trust.bans

    monkeypatch.setattr(swarm.trust.bans, "MAX_TRACKED", 50)
    bans = Bans()
    for i in range(500):
        bans.record_bad_request(f"peer{i}", float(i))
    assert len(bans._offenders) == 50


def test_time_spent_banned_does_not_count_as_clean():
    bans, now = Bans(), 0.0
    for _ in range(8):  # up to the longest ban
        length = offend(bans, "a", now)
        now += length + 1
    assert length == MAX_BAN
    assert offend(bans, "a", now) == MAX_BAN  # right after a maximal ban: not forgiven
