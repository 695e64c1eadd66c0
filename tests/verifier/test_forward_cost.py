import pytest

from deploy.verifier.forward_cost import PiecewiseCost


def test_piecewise_cost_recovers_a_straight_line():
    c = PiecewiseCost()
    for x in (10, 50, 100, 200, 400):
        c.observe(x, 0.02 + 0.001 * x)
    c.refit()
    assert c.predict(300) == pytest.approx(0.32, rel=1e-6) and c.predict(10) == pytest.approx(0.03, rel=1e-6)


def test_piecewise_cost_finds_the_memory_bound_knee():
    """Flat up to ~32 rows, then linear (a CPU batch turning compute-bound)."""
    c = PiecewiseCost()
    for x in (1, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256):
        c.observe(x, 0.018 + 0.0004 * max(0, x - 32))
    c.refit()
    a, b, knee = c.coefficients()
    assert knee == 32 and a == pytest.approx(0.018, abs=1e-9) and b == pytest.approx(0.0004, rel=1e-6)
    assert c.predict(8) == pytest.approx(c.predict(30)) and c.predict(200) > c.predict(100)


def test_the_one_pass_fit_is_the_least_squares_fit_at_every_knee():
    """The suffix-sum refit gives the curve a direct weighted least squares per knee gives,
    over the row counts' means, each weighted by its count."""
    import random

    def direct(points):  # per knee: centred weighted sums, b >= 0, least relative error wins
        best = None
        for knee in [0.0] + sorted({x for x, _, _ in points})[:-1]:
            ws = [n / y ** 2 for _, y, n in points]
            hs = [max(0.0, x - knee) for x, _, _ in points]
            sw = sum(ws)
            mh = sum(w * h for w, h in zip(ws, hs)) / sw
            my = sum(w * y for w, (_, y, _) in zip(ws, points)) / sw
            var = sum(w * (h - mh) ** 2 for w, h in zip(ws, hs))
            b = max(0.0, sum(w * (h - mh) * (y - my) for w, h, (_, y, _) in zip(ws, hs, points)) / var) if var else 0.0
            a = my - b * mh
            err = sum(w * (a + b * h - y) ** 2 for w, h, (_, y, _) in zip(ws, hs, points))
            if best is None or err < best[0]:
                best = (err, a, b, knee)
        return best[1:]

    rng = random.Random(3)
    for _ in range(50):
        knee, a, b = rng.choice([0, 3, 12]), rng.uniform(0.005, 0.05), rng.uniform(0.0, 0.003)
        c = PiecewiseCost()
        for _ in range(rng.randint(2, 120)):
            x = float(rng.randint(1, 48))
            c.observe(x, (a + b * max(0.0, x - knee)) * rng.uniform(0.8, 1.25))
        c.refit()
        want = PiecewiseCost()
        want._fit = direct(c.points())
        for rows in range(int(min(x for x, _, _ in c.points())), 64):  # left of every point, equal fits may differ
            assert c.predict(rows) == pytest.approx(want.predict(rows), rel=1e-9)


def test_a_row_count_keeps_its_mean_when_the_load_moves_on():
    """Thousands of forwards at one size (run-ahead: one row per session) do not flatten the
    slope while another size is still seen now and then (the pacer's exploration): a tree still
    costs what it did."""
    c = PiecewiseCost()
    curve = lambda x: 0.015 + 0.002 * max(0, x - 2)  # noqa: E731
    for x in (1, 2, 4, 8, 16, 33):
        for _ in range(4):
            c.observe(x, curve(x))
    for i in range(5000):
        c.observe(33 if i % 256 == 255 else 4, curve(33 if i % 256 == 255 else 4))
    c.refit()
    assert c.predict(16) == pytest.approx(curve(16), rel=1e-6) and c.count == 5024


def test_a_row_count_not_seen_lately_leaves_the_fit():
    """A cold start's dear forwards (a first forward at each size) at a size the replica then
    never runs again do not bend the curve for its life: after ``stale_forwards`` forwards
    without it, the curve is the fresh sizes' again, and a forward of that size starts it anew."""
    curve = lambda x: 0.010 + 0.0002 * max(0, x - 8)  # noqa: E731
    c = PiecewiseCost(stale_forwards=256)
    for _ in range(3):
        c.observe(33, 3 * curve(33))
    for i in range(256):
        c.observe(17 if i % 2 else 65, curve(17 if i % 2 else 65))
    c.refit()
    assert 33.0 in [x for x, _, _ in c.points()]  # not yet stale
    for i in range(8):
        c.observe(17 if i % 2 else 65, curve(17 if i % 2 else 65))
    c.refit()
    assert 33.0 not in [x for x, _, _ in c.points()]
    assert c.predict(33) == pytest.approx(curve(33), rel=1e-6)
    c.observe(33, curve(33))
    assert [w for x, _, w in c.points() if x == 33.0] == [1.0]


def test_one_row_count_gives_a_flat_curve_not_rounding_noise():
    """A replica that only ever saw one row count (one session decoding) has no slope to
    measure: the curve is flat at the mean, whatever the count."""
    import random

    rng = random.Random(1)
    for rows in (1, 4, 40):
        c = PiecewiseCost()
        for _ in range(256):
            c.observe(rows, 0.015 * rng.uniform(0.9, 1.1))
        c.refit()
        assert c.coefficients()[1] == 0.0 and c.predict(64) == pytest.approx(0.015, rel=0.05)
