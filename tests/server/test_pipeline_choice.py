from __future__ import annotations

from graftlm.server.pipeline import Choice, Delta, TokenLogprob


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
