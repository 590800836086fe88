"""Drafting by lookup: what it proposes, how many of its tokens it keeps, what it learns."""
import pytest

from specinfer.lookup import MATCH_PROBABILITY, REPEAT_PROBABILITY, LookupDrafter
from specinfer.tree_sizing import Acceptance, StepCost, TreeSizer

CHEAP = StepCost((1, 16), (1.0, 1.05))     # tree tokens nearly free: every likely token pays
DEAR = StepCost((1, 2), (1.0, 2.0))        # each token costs a whole step: none pays


def drafter(history, cost=CHEAP, depth=8):
    d = LookupDrafter(index=1, sizer=TreeSizer(cost, overhead=0.1), record=Acceptance(), depth=depth)
    d.prefill(history)
    return d


def chain(tree):
    assert all(p == i for i, p in enumerate(tree.parents[1:]))   # a chain from the root
    assert all(pr.ssm == 1 and pr.rank == 0 and pr.q is None for ps in tree.proposals[1:] for pr in ps)
    return tree.tokens[1:]


def test_copies_what_followed_the_latest_longest_match():
    # "7 8" occurred twice: the latest occurrence was followed by 4 5 6; "8" alone also by 9.
    d = drafter([1, 7, 8, 9, 2, 7, 8, 4, 5, 6, 3, 7])
    # Up to the root, included; past it the copy goes on from its own tokens: 4 5 again.
    assert chain(d.draft(8, budget=64)) == [4, 5, 6, 3, 7, 8, 4, 5]
    d.commit([8])
    assert chain(d.draft(9, budget=64)) == [2, 7, 8, 4, 5, 6, 3, 7]   # depth 8 at most


def test_a_repeating_run_is_copied_on_past_its_end():
    # "a b" repeated: the latest "b a b" ended two tokens ago, and the copy goes on a b a b ...
    d = drafter([5, 1, 2, 1, 2, 1])
    assert chain(d.draft(2, budget=64)) == [1, 2, 1, 2, 1, 2, 1, 2]
    # The two tokens that did follow "b a b" are rated as a three-token match; the repeats apart.
    assert [p for _, p in d._chain] == [MATCH_PROBABILITY[3]] * 2 + [REPEAT_PROBABILITY] * 6
    assert chain(d.draft(2, budget=4)) == [1, 2, 1]


def test_nothing_to_copy():
    d = drafter([1, 2, 3])
    assert len(d.draft(4, budget=64)) == 1            # 4 never occurred
    d.commit([4])
    assert len(d.draft(5, budget=64)) == 1
    # The sequence's end is never matched with itself: a lone token has nothing after it yet.
    assert len(drafter([]).draft(3, budget=64)) == 1


def test_keeps_as_many_tokens_as_pay_and_fit():
    history = [1, 2, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 1, 2]     # "1 2 5" matches: nominal 0.7 a token
    assert len(drafter(history).draft(5, budget=64)) == 9      # the root and 8
    assert len(drafter(history).draft(5, budget=4)) == 4       # the budget
    assert len(drafter(history, cost=DEAR).draft(5, budget=64)) == 1
    # A one-token match is worth less (nominal 0.3 a token): fewer of its tokens pay.
    assert 1 < len(drafter(history[2:]).draft(5, budget=64)) < 9


def test_learns_which_copies_are_accepted():
    d = drafter([5, 6, 7, 8, 9, 5, 6, 7, 1, 2])
    record, p = d.record, MATCH_PROBABILITY[1]
    before = record([p], 0)[0]
    for _ in range(40):    # the LLM takes the first two copied tokens, never the third
        tree = d.draft(5, budget=64)
        assert chain(tree)[:3] == [6, 7, 1]
        d.commit([5, 6, 7])
        d.release()
        d.prefill([5, 6, 7, 8, 9, 5, 6, 7, 1, 2])
    # 2 of every 3 reached tokens accepted: the record rates a copy so, not at its nominal 0.3.
    assert before == p and record([p], 0)[0] == pytest.approx(2 / 3, abs=0.05)
    assert sum(record._accepted[0]) / sum(record._expected[0]) == pytest.approx((2 / 3) / p, rel=0.01)


@pytest.mark.parametrize("greedy", [True, False])
def test_learns_from_copies_it_did_not_propose_where_the_path_shows_the_llms_tokens(greedy):
    """Greedy, the path is the LLM's own tokens, so a copy it did not propose (drafts that do not
    pay, a step that took a chain instead) is accepted or not as verification would have judged it,
    as far as the path goes; sampled, a path says nothing of a token never verified."""
    d = LookupDrafter(index=1, sizer=TreeSizer(DEAR, overhead=0.1), record=Acceptance(), depth=8, greedy=greedy)
    d.prefill([5, 6, 7, 8, 9, 5, 6, 7, 1, 2])
    assert len(d.draft(5, budget=64)) == 1                  # too dear: proposes none of 6 7 1 2 ...
    d.commit([5, 6, 7, 3])                                  # the LLM took 6 and 7, then 3, not 1
    # (What the record has counted, in steps' worth: earlier steps count 0.99 a step less.)
    counts = lambda record: [sum(c[0]) / record._weight for c in (record._seen, record._accepted)]  # noqa: E731
    assert counts(d.record) == pytest.approx([3, 2] if greedy else [0, 0])
    # A path shorter than the copy: only the tokens it shows are judged.
    d.draft(3, budget=64)                                   # "7 3" never occurred: "3" alone
    d.commit([3, 8])
    assert d.draft(8, budget=64) is not None and d._chain[:1] == [(9, MATCH_PROBABILITY[1])]
    d.commit([8, 9])                                        # 9 taken; what follows it not shown
    assert counts(d.record) == pytest.approx([4, 3] if greedy else [0, 0], rel=0.01)


def test_release_forgets_the_sequence():
    d = drafter([1, 2, 3, 1])
    assert chain(d.draft(2, budget=64))[:2] == [3, 1]
    d.release()
    assert len(d.draft(2, budget=64)) == 1
