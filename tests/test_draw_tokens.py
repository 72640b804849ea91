"""``molt_core.sampling.draw_tokens``: the batched draw gives exactly the token
``torch.multinomial`` gives row by row from the same generator state (so a seeded rollout
samples what it sampled before the batching), on every path, and still refuses a row that is
not a distribution."""

import pytest
import torch

from molt_core.sampling import BATCHED_DRAW_MAX_VOCAB, draw_tokens, processed_logprobs

torch.set_num_threads(1)


def _per_row(lp, seeds):
    gens = [torch.Generator().manual_seed(s) for s in seeds]
    return [int(torch.multinomial(lp[j].exp(), 1, generator=g)) for j, g in enumerate(gens)]


@pytest.mark.parametrize("vocab,top_k,top_p,temp", [(512, -1, 1.0, 1.0), (512, 5, 1.0, 0.7), (300, -1, 0.9, 1.3),
                                                    (BATCHED_DRAW_MAX_VOCAB + 1, -1, 1.0, 1.0)])
def test_draw_tokens_equals_per_row_multinomial(vocab, top_k, top_p, temp):
    logits = torch.randn(64, vocab, generator=torch.Generator().manual_seed(vocab)) * 3
    lp = processed_logprobs(logits, temp, top_k, top_p)
    for base in range(5):
        seeds = [base * 1000 + j for j in range(64)]
        gens = [torch.Generator().manual_seed(s) for s in seeds]
        got = draw_tokens(lp, gens).tolist()
        assert got == _per_row(lp, seeds)
        # each generator advanced exactly as multinomial advances it: the next draw agrees too
        ref = [torch.Generator().manual_seed(s) for s in seeds]
        for j, g in enumerate(ref):
            torch.multinomial(lp[j].exp(), 1, generator=g)
        assert [float(torch.rand(1, generator=g)) for g in gens] == [float(torch.rand(1, generator=g)) for g in ref]
    if top_k > 0:  # never a filtered token
        assert all(lp[j, t] > float("-inf") for j, t in enumerate(got))


def test_draw_tokens_refuses_what_multinomial_refuses():
    lp = torch.log_softmax(torch.randn(3, 16), -1)
    lp[1, 4] = float("nan")
    with pytest.raises(RuntimeError):
        draw_tokens(lp, [None, None, None])
    zero = torch.full((2, 16), float("-inf"))
    with pytest.raises(RuntimeError):
        draw_tokens(zero, [None, None])
    assert draw_tokens(torch.zeros(0, 16), []).shape == (0,)
