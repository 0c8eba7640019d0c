from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

import pytest

from graftlm.server.pipeline import Choice, Delta, TokenLogprob, collect
from graftlm.server.state import ApiError


def test_a_choice_folds_its_pieces_in_order() -> None:
    c = Choice(0)
    assert c.text == "" and c.tokens == []
    c.add(Delta(0, "ab", [1, 2], [TokenLogprob(1, -0.5), TokenLogprob(2, -1.0)]))
    assert c.text == "ab"  # read between pieces, as a stream's running choice is
    c.add(Delta(0, "", [3]))
    c.add(Delta(0, "cé", [4], echo=True))
    for i in range(1000):
        c.add(Delta(0, str(i % 10), [i]))
    assert c.text == "abcé" + "".join(str(i % 10) for i in range(1000))
    assert c.tokens == [1, 2, 3, *range(1000)] and c.n_echo_tokens == 1
    assert [lp.token for lp in c.logprobs] == [1, 2] and c.finish is None


class _Channel:
    """A request's receive channel: `fail` raises, else the client leaves after `leave_after`
    polls (None: it never does)."""

    def __init__(self, fail: bool = False, leave_after: int | None = None) -> None:
        self.fail, self.leave_after, self.polls = fail, leave_after, 0

    async def receive(self) -> dict[str, object]:
        self.polls += 1
        if self.fail:
            raise RuntimeError("the channel broke")
        if self.leave_after is not None and self.polls > self.leave_after:
            return {"type": "http.disconnect"}
        await asyncio.sleep(0.01)
        return {"type": "http.request", "body": b"", "more_body": False}


async def _pieces(n: int, pause: float) -> AsyncGenerator[Delta, None]:
    for i in range(n):
        await asyncio.sleep(pause)
        yield Delta(0, str(i), [i])


def test_collect_answers_whole_when_the_receive_channel_fails() -> None:
    """A failing receive channel is not a client that left: the answer is made whole."""
    ch = _Channel(fail=True)
    choices = asyncio.run(collect(ch, _pieces(5, 0.01), 1))  # type: ignore[arg-type]
    assert choices[0].text == "01234" and ch.polls == 1


def test_collect_stops_when_the_client_leaves() -> None:
    ch = _Channel(leave_after=2)
    with pytest.raises(ApiError) as e:
        asyncio.run(collect(ch, _pieces(1000, 0.01), 1))  # type: ignore[arg-type]
    assert e.value.status == 499
