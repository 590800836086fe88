"""sampling.py: the shaped distribution and the inverse-CDF draw every rule and incremental
sampling share."""
import numpy as np
import pytest

from specinfer.sampling import SAMPLE_BLOCK, SamplingParams, probabilities, sample


class FixedDraw:
    """An rng whose uniform draw is given."""

    def __init__(self, u: float):
        self.u = u

    def random(self) -> float:
        return self.u


def one_level(p: np.ndarray, u: float) -> int:
    """The textbook inverse CDF: the first token whose cumulative mass exceeds u times the total."""
    c = np.cumsum(p)
    return int(np.searchsorted(c, u * c[-1], side="right"))


@pytest.fixture(params=["native", "numpy"])
def drawn_by(request, monkeypatch):
    """sample() by the native inverse CDF (where the library runs) and by numpy's."""
    from specinfer.engines import native

    if request.param == "native" and native.library() is None:
        pytest.skip("the native kernels need Linux x86-64 with AVX2, FMA and F16C and a C compiler")
    if request.param == "numpy":
        monkeypatch.setattr(native, "sample_residual", lambda *a: None)
    return request.param


@pytest.mark.parametrize("vocab", [7, 2 * SAMPLE_BLOCK, 1000, 8192])
def test_the_two_level_draw_is_the_inverse_cdf(vocab, drawn_by):
    rng = np.random.default_rng(vocab)
    p = rng.random(vocab) ** 4
    p[rng.random(vocab) < 0.3] = 0.0          # tokens without mass, some whole runs of them
    p[vocab // 3: vocab // 3 + SAMPLE_BLOCK] = 0.0
    p /= p.sum()
    c = np.cumsum(p)
    # Uniform draws, and draws right on the boundary between two tokens (where a block's sum and
    # the running sum may round apart): the token one cumulative sum gives, or the draw sat on the
    # boundary between the two, up to rounding.
    us = list(rng.random(500)) + [float(x) for x in c[rng.integers(0, vocab, 200)] / c[-1]] + [0.0]
    for u in us:
        token = sample(p, FixedDraw(u))
        assert p[token] > 0
        expected = one_level(p, u)
        assert token == expected or abs(c[min(token, expected)] - u * c[-1]) < 1e-12


def test_a_draw_of_the_whole_mass_takes_the_last_token_with_mass(drawn_by):
    p = np.zeros(4 * SAMPLE_BLOCK + 5)
    p[[3, SAMPLE_BLOCK + 1, 2 * SAMPLE_BLOCK + 7]] = [0.2, 0.5, 0.3]
    assert sample(p, FixedDraw(np.nextafter(1.0, 0.0))) == 2 * SAMPLE_BLOCK + 7
    assert sample(p, FixedDraw(0.0)) == 3
    assert sample(p, FixedDraw(0.2)) == SAMPLE_BLOCK + 1


def test_draws_follow_the_distribution():
    rng = np.random.default_rng(0)
    p = np.zeros(3000)
    p[[5, 700, 2999]] = [0.25, 0.5, 0.25]
    counts = np.bincount([sample(p, rng) for _ in range(4000)], minlength=3000)
    assert counts.sum() == counts[[5, 700, 2999]].sum()
    assert abs(counts[700] / 4000 - 0.5) < 0.03


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.7), SamplingParams(temperature=1.3, top_k=5),
                                    SamplingParams(temperature=1.0, top_p=0.8)])
def test_probabilities_are_the_shaped_softmax(params):
    logits = np.random.default_rng(1).standard_normal((3, 50)).astype(np.float32) * 3
    z = logits.astype(np.float64) / params.temperature
    expected = []
    for row in z:
        if params.top_k:
            row = np.where(row < np.sort(row)[-params.top_k], -np.inf, row)
        e = np.exp(row - row.max())
        e /= e.sum()
        if params.top_p < 1:
            order = np.argsort(-e)
            keep = order[:int(np.searchsorted(np.cumsum(e[order]), params.top_p)) + 1]
            e = np.where(np.isin(np.arange(len(e)), keep), e, 0.0)
            e /= e.sum()
        expected.append(e)
    got = probabilities(logits, params)
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, np.array(expected), rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(probabilities(logits[1], params), got[1], rtol=1e-15)
    greedy = probabilities(logits, SamplingParams())
    assert (greedy.argmax(-1) == logits.argmax(-1)).all() and (greedy.sum(-1) == 1).all()


@pytest.mark.parametrize("vocab", [5, 8, 1000, 8192])
def test_the_native_shaping_is_numpys_float64_softmax(vocab, monkeypatch):
    """kernels/shaping.c (where the native kernels run) against the numpy shaping it replaces."""
    from specinfer.engines import native

    if native.library() is None:
        pytest.skip("the native kernels need Linux x86-64 with AVX2, FMA and F16C and a C compiler")
    logits = (np.random.default_rng(vocab).standard_normal((3, vocab)) * 4).astype(np.float32)
    logits[0, :2] = -np.inf   # masked tokens have no mass
    for temperature in (0.05, 0.7, 1.0, 2.5):
        got = native.softmax(logits, temperature)
        with monkeypatch.context() as m:
            m.setattr(native, "softmax", lambda *a: None)   # probabilities() on numpy alone
            expected = probabilities(logits, SamplingParams(temperature=temperature))
        np.testing.assert_allclose(got, expected, rtol=1e-13, atol=1e-250)
        assert (got[0, :2] == 0).all() and np.allclose(got.sum(-1), 1, rtol=0, atol=1e-13)
        np.testing.assert_array_equal(probabilities(logits, SamplingParams(temperature=temperature)), got)
    assert native.softmax(logits.astype(np.float64), 0.7) is None   # float64 logits: numpy's path


@pytest.mark.parametrize("vocab", [5, 300, 8192])
def test_the_native_draws_are_the_inverse_cdf(vocab, monkeypatch):
    """sampling.draw (one native call from the logits) and verify.residual_draw (one native pass over
    p and q) pick, for the same uniform, the token the numpy inverse CDF picks on the distribution
    written out; without the library, draw() is sample(probabilities()) and reads one uniform too."""
    from specinfer.engines import native
    from specinfer.sampling import draw, inverse_cdf
    from specinfer.verify import residual, residual_draw

    if native.library() is None:
        pytest.skip("the native kernels need Linux x86-64 with AVX2, FMA and F16C and a C compiler")
    native_residual = native.sample_residual

    def numpy_inverse_cdf(p, u):
        with monkeypatch.context() as m:
            m.setattr(native, "sample_residual", lambda *a: None)
            return inverse_cdf(p, u)

    rng = np.random.default_rng(vocab)
    for trial in range(200):
        logits = (rng.standard_normal(vocab) * 3).astype(np.float32)
        logits[rng.integers(0, vocab)] = -np.inf   # a masked token: never drawn
        params = SamplingParams(temperature=float(rng.choice([0.3, 0.7, 1.0, 1.6])))
        u = float(rng.random())
        p = probabilities(logits, params)
        token = native.sample_softmax(logits, params.temperature, u)
        assert token == numpy_inverse_cdf(p, u) and p[token] > 0
        assert native_residual(p, None, u) == token
        q = probabilities(logits + rng.standard_normal(vocab).astype(np.float32), params)
        assert residual_draw(p, q, u) == numpy_inverse_cdf(residual(p, q), u)
    assert residual_draw(p, p, 0.5) == numpy_inverse_cdf(p, 0.5)   # no residual mass: drawn from p, as residual() says
    seeds = [np.random.default_rng(1), np.random.default_rng(1)]
    native_token = draw(logits, params, seeds[0])
    monkeypatch.setattr(native, "library", lambda: None)
    native._shaping.cache_clear()
    try:
        assert draw(logits, params, seeds[1]) == native_token   # numpy's path: the same token, one uniform each
        assert seeds[0].random() == seeds[1].random()
    finally:
        native._shaping.cache_clear()
