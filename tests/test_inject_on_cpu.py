import json
import math
import subprocess
import sys
import threading
import time
from pathlib import Path
from statistics import NormalDist

import numpy as np
import pytest

from rollart_dask.envs.frozenlake import FrozenLakeText
from rollart_dask.envs.inject import LATENCY_DIR, Injected, InjectedFailure, InjectSpec, draw, injected, load_latencies, parse_spec

EXAMPLE = "reset_heavy_tail_example.csv"
QS = (0.5, 0.9, 0.99)


class Echo:
    """Trivial env: counts the calls that reach it."""

    action_choices = ("a", "b")

    def __init__(self):
        self.resets = self.steps = 0
        self.closed = False
        self.info = {"k": 1}

    def reset(self, seed):
        self.resets += 1
        return f"start {seed}", self.info

    def step(self, action):
        self.steps += 1
        return action, 1.0, False, False, {"n": self.steps}

    def close(self):
        self.closed = True


class Bare:
    def reset(self, seed):
        return "", {}

    def step(self, action):
        return "", 0.0, True, False, {}

    def close(self):
        pass


class Recorder(list):
    def __call__(self, seconds):
        self.append(seconds)


def play(spec, episodes, steps, seed0=0):
    """Run episodes with a recording sleep; return (reset sleeps, step sleeps, reset outcomes, step outcomes)."""
    rec = Recorder()
    reset_s, step_s, reset_ok, step_ok = [], [], [], []
    for ep in range(seed0, seed0 + episodes):
        env = Injected(Echo(), spec, sleep=rec)
        try:
            _, info = env.reset(seed=ep)
            reset_ok.append(True)
            reset_s.append(info["injected"]["reset_s"])
        except InjectedFailure:
            reset_ok.append(False)
            continue
        for _ in range(steps):
            try:
                step_s.append(env.step("a")[4]["injected"]["step_s"])
                step_ok.append(True)
            except InjectedFailure:
                step_ok.append(False)
    return np.array(reset_s), np.array(step_s), np.array(reset_ok), np.array(step_ok), rec


def binomial_ok(successes, n, p, sigmas=4.0):
    return abs(successes - n * p) <= sigmas * math.sqrt(n * p * (1 - p)) + 1


def test_lognormal_quantiles_match_analytic():
    m, s = 2.0, 0.8
    spec = {
        "seed": 3,
        "reset_latency": {"dist": "lognormal", "median_s": 5.0, "sigma": 0.3},
        "step_latency": {"dist": "lognormal", "median_s": m, "sigma": s},
    }
    reset_s, step_s, *_ = play(spec, episodes=2000, steps=10)
    assert len(step_s) == 20000
    for q, tol in zip(QS, (0.03, 0.05, 0.10)):
        expect = m * math.exp(s * NormalDist().inv_cdf(q))
        assert np.quantile(step_s, q) == pytest.approx(expect, rel=tol), q
        expect = 5.0 * math.exp(0.3 * NormalDist().inv_cdf(q))
        assert np.quantile(reset_s, q) == pytest.approx(expect, rel=tol + 0.02), q


def test_lognormal_cap_holds():
    cap = 2.0 * math.exp(0.8 * NormalDist().inv_cdf(0.9))  # the uncapped p90
    spec = parse_spec({"step_latency": {"dist": "lognormal", "median_s": 2.0, "sigma": 0.8, "cap_s": cap}})
    xs = np.array([draw(spec, ep, 1).latency_s for ep in range(5000)])
    assert xs.max() == pytest.approx(cap) and np.all(xs <= cap)
    assert binomial_ok(int(np.sum(xs >= cap)), 5000, 0.1)


def test_empirical_reproduces_csv_quantiles():
    pts = load_latencies(LATENCY_DIR / EXAMPLE)
    spec = parse_spec({"reset_latency": {"dist": "empirical", "file": EXAMPLE}})
    xs = np.array([draw(spec, ep, 0).latency_s for ep in range(20000)])
    assert pts.min() <= xs.min() and xs.max() <= pts.max()
    for q, tol in zip(QS, (0.03, 0.05, 0.12)):
        assert np.quantile(xs, q) == pytest.approx(np.quantile(pts, q), rel=tol), q
    # The example is heavy-tailed, as its header says.
    assert np.quantile(pts, 0.99) > 10 * np.quantile(pts, 0.5)


def test_empirical_absolute_path_and_header(tmp_path):
    f = tmp_path / "lat.csv"
    f.write_text("# comment\nseconds\n1\n3\n2\n")
    spec = parse_spec({"step_latency": {"dist": "empirical", "file": str(f), "cap_s": 2.5}})
    xs = [draw(spec, ep, 1).latency_s for ep in range(2000)]
    assert 1.0 <= min(xs) and max(xs) == 2.5


def test_failure_rates_match_and_never_reach_inner_env():
    spec = {"seed": 5, "reset_fail": 0.1, "step_fail": 0.05}
    _, _, reset_ok, step_ok, _ = play(spec, episodes=4000, steps=3)
    assert binomial_ok(int((~reset_ok).sum()), len(reset_ok), 0.1)
    assert binomial_ok(int((~step_ok).sum()), len(step_ok), 0.05)
    # A failed call leaves the inner env untouched and names the injection and call.
    for ep in range(200):
        inner = Echo()
        env = Injected(inner, {"reset_fail": 0.5})
        try:
            env.reset(ep)
        except InjectedFailure as e:
            assert inner.resets == 0 and "emulated failure" in str(e) and "reset" in str(e) and f"episode seed {ep}" in str(e)
            with pytest.raises(RuntimeError, match="before a successful reset"):
                env.step("a")
            break
    else:
        pytest.fail("no reset failed at rate 0.5")


def test_hangs_at_configured_rate_with_fake_sleep():
    spec = {"seed": 2, "hang_p": 0.02, "time_scale": 0.5}
    _, _, reset_ok, step_ok, rec = play(spec, episodes=1000, steps=5)
    calls = len(reset_ok) + len(step_ok)
    hangs = int((~reset_ok).sum() + (~step_ok).sum())
    assert binomial_ok(hangs, calls, 0.02)
    assert rec == [1800.0] * hangs  # default hang_s 3600, scaled; no latency configured, so no other sleeps
    env = Injected(Echo(), {"hang_p": 1.0, "hang_s": 10}, sleep=Recorder())
    with pytest.raises(InjectedFailure, match="emulated hang"):
        env.reset(0)


def test_resets_and_steps_hang_at_their_own_rates():
    """reset_hang_p / step_hang_p set each call's hang rate; left out, hang_p is both."""
    _, _, reset_ok, step_ok, _ = play({"seed": 3, "reset_hang_p": 1.0, "step_hang_p": 0.0, "hang_p": 0.5}, episodes=50, steps=0)
    assert not reset_ok.any()  # every reset hangs
    _, _, reset_ok, step_ok, _ = play({"seed": 3, "reset_hang_p": 0.0, "hang_p": 1.0}, episodes=50, steps=3)
    assert reset_ok.all() and not step_ok.any()  # no reset hangs; steps take hang_p


def test_reproducible_by_seeds_only():
    spec = {
        "seed": 7,
        "reset_latency": {"dist": "lognormal", "median_s": 1, "sigma": 1},
        "step_latency": {"dist": "empirical", "file": EXAMPLE},
        "reset_fail": 0.2,
        "step_fail": 0.2,
    }
    a, b = play(spec, 300, 4), play(spec, 300, 4)
    for x, y in zip(a, b):
        assert np.array_equal(np.asarray(x), np.asarray(y))
    other_eps = play(spec, 300, 4, seed0=1000)
    assert not np.array_equal(a[0][:50], other_eps[0][:50])
    other_spec = play({**spec, "seed": 8}, 300, 4)
    assert not np.array_equal(a[0][:50], other_spec[0][:50])
    # Failure rates do not move latencies: the same random numbers are drawn whatever the spec.
    s1, s2 = parse_spec(spec), parse_spec({**spec, "reset_fail": 0.0, "step_fail": 0.9})
    assert all(draw(s1, ep, i).latency_s == draw(s2, ep, i).latency_s for ep in range(50) for i in range(3))
    # Different episode seeds differ; negative and huge seeds are fine; call index matters.
    assert len({draw(s1, ep, 0).latency_s for ep in (-1, 0, 1, 2**70)}) == 4
    assert draw(s1, 4, 1).latency_s != draw(s1, 4, 2).latency_s


def test_same_draws_in_another_process():
    spec = {"seed": 11, "step_latency": {"dist": "lognormal", "median_s": 1, "sigma": 1}}
    code = (
        "import json; from rollart_dask.envs.inject import draw, parse_spec; "
        f"s = parse_spec({spec!r}); print(json.dumps([draw(s, ep, i).latency_s for ep in range(5) for i in range(1, 4)]))"
    )
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True).stdout
    s = parse_spec(spec)
    assert json.loads(out) == [draw(s, ep, i).latency_s for ep in range(5) for i in range(1, 4)]


def test_redraw_repeats():
    base = {"seed": 13, "reset_latency": {"dist": "lognormal", "median_s": 1, "sigma": 1}}
    same = [Injected(Echo(), base, sleep=Recorder()).reset(99)[1]["injected"]["reset_s"] for _ in range(3)]
    assert len(set(same)) == 1
    fresh = [
        Injected(Echo(), {**base, "seed": 14, "redraw_repeats": True}, sleep=Recorder()).reset(99)[1]["injected"]["reset_s"]
        for _ in range(3)
    ]
    assert len(set(fresh)) == 3


def test_time_scale_scales_every_sleep():
    spec = {"seed": 1, "reset_latency": {"dist": "lognormal", "median_s": 3, "sigma": 1}, "step_latency": {"dist": "constant", "s": 2.0}}
    full, scaled = play(spec, 50, 3)[4], play({**spec, "time_scale": 0.01}, 50, 3)[4]
    assert len(full) == len(scaled) == 200
    assert np.allclose(np.array(scaled), np.array(full) * 0.01)
    assert play({**spec, "time_scale": 0}, 10, 3)[4] == []  # 0 turns sleeping off


def test_labels_choices_close_and_describe():
    inner, rec = Echo(), Recorder()
    env = Injected(
        inner, {"reset_latency": {"dist": "constant", "s": 4}, "step_latency": {"dist": "constant", "s": 1}, "time_scale": 0.5}, sleep=rec
    )
    obs, info = env.reset(seed=1)
    assert obs == "start 1" and info["k"] == 1 and "injected" not in inner.info
    assert info["injected"] == {"emulated": True, "reset_s": 2.0, "step_s": 0.0, "total_s": 2.0, "call": 0, "spec_seed": 0}
    *_, info = env.step("b")
    assert info["n"] == 1 and info["injected"] == {
        "emulated": True,
        "reset_s": 2.0,
        "step_s": 0.5,
        "total_s": 2.5,
        "call": 1,
        "spec_seed": 0,
    }
    assert rec == [2.0, 0.5]
    assert env.action_choices == ("a", "b") and not hasattr(Injected(Bare()), "action_choices")
    desc = env.describe()
    assert desc["emulated"] is True and desc["time_scale"] == 0.5 and desc["reset_latency"] == {"dist": "constant", "s": 4.0}
    json.dumps(desc)
    json.dumps(Injected(Echo(), {"reset_latency": {"dist": "empirical", "file": EXAMPLE}}).describe())
    env.close()
    assert inner.closed
    # A real env: attributes forward, info labelled.
    fl = Injected(FrozenLakeText(), {"step_latency": {"dist": "constant", "s": 0}})
    _, info = fl.reset(3)
    assert info["injected"]["emulated"] and fl.action_choices == tuple("LDRU") and fl.shortest_path()


def test_factories():
    env = injected("rollart_dask.envs.frozenlake:FrozenLakeText", {"step_fail": 1.0}, size=3)
    assert env.size == 3 and env.reset(0)[1]["injected"]["emulated"]
    with pytest.raises(InjectedFailure):
        env.step("L")
    env = injected("rollart_dask.envs.frozenlake:FrozenLakeText", {"reset_latency": None}, size=5)
    assert len(env.reset(1)[0].split("\n")) == 5
    with pytest.raises(ValueError, match="module:attr"):
        injected("frozenlake")
    with pytest.raises(ValueError, match="unknown key 'bogus'"):
        injected("rollart_dask.envs.frozenlake:FrozenLakeText", {"bogus": 1})


@pytest.mark.parametrize(
    "spec, message",
    [
        ({"bogus": 1}, r"unknown key 'bogus'; allowed: seed, reset_latency, step_latency, reset_fail"),
        (
            {"reset_latency": {"dist": "lognormal", "median_s": 1, "sigma": 1, "cap": 2}},
            r"unknown key 'reset_latency.cap'; allowed: dist, median_s, sigma, cap_s",
        ),
        ({"step_latency": {"dist": "gamma"}}, r"step_latency.dist is required, one of: none, constant, lognormal, normal, empirical"),
        ({"step_latency": {"median_s": 1}}, r"step_latency.dist is required"),
        ({"reset_latency": {"dist": "lognormal", "median_s": 0, "sigma": 1}}, r"reset_latency.median_s: Input should be greater than 0"),
        ({"reset_latency": {"dist": "lognormal", "median_s": 1}}, r"reset_latency.sigma: Field required"),
        ({"reset_fail": 1.5}, r"reset_fail: Input should be less than or equal to 1"),
        ({"hang_p": -0.1}, r"hang_p: Input should be greater than or equal to 0"),
        ({"time_scale": "fast"}, r"time_scale: Input should be a valid number"),
        ({"reset_latency": {"dist": "empirical", "file": "missing.csv"}}, r"reset_latency: latency file .*missing.csv' not found"),
    ],
)
def test_bad_specs_name_the_key(spec, message):
    with pytest.raises(ValueError, match=message):
        Injected(Echo(), spec)


def test_bad_latency_file(tmp_path):
    f = tmp_path / "bad.csv"
    f.write_text("s\n1\nabc\n")
    with pytest.raises(ValueError, match="row 3 is not a number"):
        parse_spec({"reset_latency": {"dist": "empirical", "file": str(f)}})
    f.write_text("s\n1\n")
    with pytest.raises(ValueError, match="at least 2"):
        parse_spec({"reset_latency": {"dist": "empirical", "file": str(f)}})


def test_really_sleeps_and_close_releases_a_hang():
    env = Injected(
        Echo(), {"reset_latency": {"dist": "constant", "s": 10}, "step_latency": {"dist": "constant", "s": 5}, "time_scale": 0.01}
    )
    t0 = time.perf_counter()
    env.reset(0)
    env.step("a")
    elapsed = time.perf_counter() - t0
    # 0.1 + 0.05 s scaled: a sleep never ends early; the upper bound only has to tell it from the unscaled 15 s
    assert 0.15 <= elapsed < 5.0, elapsed
    # A hang of an hour ends (as a failure) once the env is closed, e.g. after the caller timed out.
    hung = Injected(Echo(), {"hang_p": 1.0})
    errors = []

    def call():
        try:
            hung.reset(0)
        except InjectedFailure as e:
            errors.append(e)

    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(0.2)
    assert t.is_alive()
    hung.close()
    t.join(2.0)
    assert not t.is_alive() and "emulated hang" in str(errors[0])


def test_spec_object_accepted():
    spec = InjectSpec(seed=3, reset_fail=0.5)
    assert Injected(Echo(), spec).spec is spec
