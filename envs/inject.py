"""EMULATED latency, failure and hang injection around any env, for ablations.

Nothing injected here is real environment behaviour: every info returned carries
``info["injected"]["emulated"] = True`` and ``describe()`` says so too, so results produced
with it can always be told apart from results on real, slow environments.

    env = Injected(FrozenLakeText(), {
        "seed": 1,
        "reset_latency": {"dist": "lognormal", "median_s": 8, "sigma": 1.0, "cap_s": 600},
        "step_latency": {"dist": "constant", "s": 0.2},
        "reset_fail": 0.02, "step_fail": 0.005, "hang_p": 0.001, "time_scale": 0.01,
    })

Per call, in order: sleep the drawn latency; on a hang, sleep ``hang_s`` more and raise
``InjectedFailure``; on a failure, raise ``InjectedFailure``; otherwise call the inner env.
A failed or hung call never reaches the inner env, so its state is unchanged.

Draws for a call depend only on (spec seed, episode seed given to reset, call index in the
episode: 0 for reset, 1.. for steps), so a replay gives the same latencies and failures on
any worker or process. Every call draws the same random numbers whatever the spec, so
changing e.g. ``step_fail`` leaves the latencies of a replay unchanged.
"""

from __future__ import annotations

import csv
import hashlib
import importlib
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from statistics import NormalDist
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_validator

LATENCY_DIR = Path(__file__).parent / "latency"
_NORMAL = NormalDist()


class InjectedFailure(RuntimeError):
    """An emulated env failure or hang raised by ``Injected``; never a real env error."""


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class NoLatency(_Model):
    dist: Literal["none"] = "none"

    def value(self, z: float, u: float) -> float:
        return 0.0


class ConstantLatency(_Model):
    dist: Literal["constant"]
    s: float = Field(ge=0, description="seconds, every call")

    def value(self, z: float, u: float) -> float:
        return self.s


class LognormalLatency(_Model):
    dist: Literal["lognormal"]
    median_s: float = Field(gt=0, description="median seconds (exp of the log-mean)")
    sigma: float = Field(ge=0, description="shape: std dev of log latency; p99 = median * exp(2.326 sigma)")
    cap_s: float | None = Field(None, gt=0, description="draws above this are clipped to it; None: no cap")

    def value(self, z: float, u: float) -> float:
        x = self.median_s * math.exp(self.sigma * z)
        return x if self.cap_s is None else min(x, self.cap_s)


class NormalLatency(_Model):
    dist: Literal["normal"]
    mean_s: float = Field(ge=0, description="mean seconds before truncation")
    sd_s: float = Field(ge=0, description="standard deviation, seconds (the paper's env latency σ)")
    cap_s: float | None = Field(None, gt=0)

    def value(self, z: float, u: float) -> float:
        x = max(0.0, self.mean_s + self.sd_s * z)  # truncated at zero: a latency is never negative
        return x if self.cap_s is None else min(x, self.cap_s)


class EmpiricalLatency(_Model):
    dist: Literal["empirical"]
    file: str = Field(
        description="CSV of observed seconds (first column; '#' comments and a header row allowed); relative paths are under envs/latency/"
    )
    cap_s: float | None = Field(None, gt=0)
    _points: np.ndarray = PrivateAttr()

    @model_validator(mode="after")
    def _load(self):
        self._points = load_latencies(self.path)
        return self

    @property
    def path(self) -> Path:
        p = Path(self.file).expanduser()
        return p if p.is_absolute() else LATENCY_DIR / p

    def value(self, z: float, u: float) -> float:
        # Inverse of the empirical CDF with linear interpolation between order statistics:
        # the same rule as numpy.quantile's default, so sample quantiles converge to the file's.
        pts = self._points
        pos = u * (len(pts) - 1)
        i = min(int(pos), len(pts) - 2)
        x = float(pts[i] + (pos - i) * (pts[i + 1] - pts[i]))
        return x if self.cap_s is None else min(x, self.cap_s)


Latency = Annotated[NoLatency | ConstantLatency | LognormalLatency | NormalLatency | EmpiricalLatency, Field(discriminator="dist")]


class InjectSpec(_Model):
    seed: int = Field(0, ge=0, description="spec seed; draws depend on it, the episode seed and the call index")
    reset_latency: Latency = NoLatency()
    step_latency: Latency = NoLatency()
    reset_fail: float = Field(0.0, ge=0, le=1, description="probability a reset raises InjectedFailure")
    step_fail: float = Field(0.0, ge=0, le=1, description="probability a step raises InjectedFailure")
    hang_p: float = Field(0.0, ge=0, le=1, description="probability a call (reset or step) hangs")
    reset_hang_p: float | None = Field(
        None, ge=0, le=1, description="probability a reset hangs (a stuck image pull or container start); None: hang_p"
    )
    step_hang_p: float | None = Field(None, ge=0, le=1, description="probability a step hangs; None: hang_p")
    hang_s: float = Field(3600.0, gt=0, description="how long a hang lasts before it raises; the caller's timeout should fire first")
    time_scale: float = Field(1.0, ge=0, description="multiplies every injected sleep (latency and hang); 0 disables sleeping")
    redraw_repeats: bool = Field(
        False,
        description=(
            "off: every reset of an episode seed replays the same draws (so a retried reset that failed fails again, "
            "and all members of a group sharing a seed get the same latencies). on: the n-th reset of the same seed "
            "in this process draws afresh; draws then also depend on the order resets arrive in a process"
        ),
    )

    def hang_of(self, call: str) -> float:
        """The hang probability of a "reset" or a "step"."""
        own = self.reset_hang_p if call == "reset" else self.step_hang_p
        return self.hang_p if own is None else own

    @model_validator(mode="before")
    @classmethod
    def _none_means_no_latency(cls, data):
        if isinstance(data, dict):
            data = {k: ({"dist": "none"} if k.endswith("_latency") and v is None else v) for k, v in data.items()}
        return data


def parse_spec(spec: dict | InjectSpec | None) -> InjectSpec:
    """Validate a spec; ValueError names the offending key and what is allowed."""
    if isinstance(spec, InjectSpec):
        return spec
    try:
        return InjectSpec.model_validate(spec or {})
    except ValidationError as e:
        raise ValueError(_explain(e)) from None


def _explain(e: ValidationError) -> str:
    lines = []
    for err in e.errors():
        loc = [str(p) for p in err["loc"]]
        # Drop the union branch pydantic inserts (reset_latency.lognormal.sigma -> reset_latency.sigma).
        loc = [p for i, p in enumerate(loc) if not (i == 1 and loc[0].endswith("_latency"))]
        key = ".".join(loc) or "spec"
        if err["type"] == "extra_forbidden":
            model = _model_at(err["loc"])
            allowed = ", ".join(model.model_fields)
            lines.append(f"injection spec: unknown key {key!r}; allowed: {allowed}")
        elif err["type"] in ("union_tag_invalid", "union_tag_not_found"):
            lines.append(f"injection spec: {key}.dist is required, one of: none, constant, lognormal, normal, empirical")
        elif err["type"] == "value_error":
            lines.append(f"injection spec: {key}: {err['ctx']['error']}")
        else:
            lines.append(f"injection spec: {key}: {err['msg']} (got {err.get('input')!r})")
    return "\n".join(lines)


def _model_at(loc: tuple) -> type[BaseModel]:
    if len(loc) >= 3 and str(loc[0]).endswith("_latency"):
        return {
            "none": NoLatency,
            "constant": ConstantLatency,
            "lognormal": LognormalLatency,
            "normal": NormalLatency,
            "empirical": EmpiricalLatency,
        }.get(str(loc[1]), InjectSpec)
    return InjectSpec


def load_latencies(path: str | Path) -> np.ndarray:
    """Sorted seconds from the first column of a CSV; '#' lines and a non-numeric header are skipped."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"latency file {str(path)!r} not found (relative names are looked up in {LATENCY_DIR})")
    values = []
    with path.open(newline="") as f:
        rows = csv.reader(line for line in f if line.strip() and not line.lstrip().startswith("#"))
        for i, row in enumerate(rows):
            try:
                values.append(float(row[0]))
            except (ValueError, IndexError):
                if i == 0:
                    continue  # header row
                raise ValueError(f"latency file {str(path)!r}: row {i + 1} is not a number: {row!r}") from None
    pts = np.sort(np.asarray(values, dtype=float))
    if len(pts) < 2 or not np.all(np.isfinite(pts)) or pts[0] < 0:
        raise ValueError(f"latency file {str(path)!r}: need at least 2 finite, non-negative seconds, got {len(pts)} values")
    return pts


@dataclass(frozen=True)
class Draw:
    """What one call gets; latency_s is before time_scale."""

    call: str  # "reset" or "step"
    latency_s: float
    fail: bool
    hang: bool


def draw(spec: InjectSpec, episode_seed: int | None, call_index: int, repeat: int | str = 0) -> Draw:
    """The injected behaviour of one call; a pure function of its arguments."""
    z, u_lat, u_fail, u_hang = _uniforms(spec.seed, episode_seed, call_index, repeat)
    z = _NORMAL.inv_cdf(z)
    if call_index == 0:
        return Draw("reset", spec.reset_latency.value(z, u_lat), u_fail < spec.reset_fail, u_hang < spec.hang_of("reset"))
    return Draw("step", spec.step_latency.value(z, u_lat), u_fail < spec.step_fail, u_hang < spec.hang_of("step"))


def _uniforms(spec_seed: int, episode_seed: int | None, call_index: int, repeat: int | str) -> list[float]:
    # A keyed hash, not a seeded generator: stable across numpy versions and processes
    # (unlike hash()), any int seed (negative, huge) keeps its own stream, and it is cheap.
    key = f"inject/{spec_seed}/{'none' if episode_seed is None else int(episode_seed)}/{call_index}/{repeat}"
    digest = hashlib.blake2b(key.encode(), digest_size=32).digest()
    # 52-bit numerators plus a half: strictly inside (0, 1), as inv_cdf needs.
    return [((int.from_bytes(digest[i : i + 8], "little") >> 12) + 0.5) / 2**52 for i in range(0, 32, 8)]


_repeats: dict[tuple, int] = {}
_repeats_lock = threading.Lock()


def _next_repeat(spec: InjectSpec, episode_seed) -> int:
    with _repeats_lock:
        key = (spec.seed, episode_seed)
        n = _repeats.get(key, 0)
        _repeats[key] = n + 1
        return n


class Injected:
    """Wraps an env; injects emulated latency, failures and hangs into reset and step.

    ``sleep`` replaces the sleeping (tests record intended delays with it). By default a
    sleep is a wait on an event that ``close()`` sets, so closing the env releases a thread
    stuck in an injected hang after its caller has timed out.
    """

    def __init__(self, env: Any, spec: dict | InjectSpec | None = None, *, sleep: Callable[[float], Any] | None = None):
        self.env = env
        self.spec = parse_spec(spec)
        self._closed = threading.Event()
        self._sleep = sleep if sleep is not None else self._closed.wait
        self._seed: int | None = None
        self._ready = False  # a successful reset happened (a failed one leaves the inner env unusable)
        self._repeat = 0
        self._calls = 0
        self._reset_s = 0.0
        self._total_s = 0.0

    @property
    def action_choices(self):
        return self.env.action_choices  # AttributeError when the inner env has none, like the env itself

    def __getattr__(self, name: str):
        if name.startswith("_") or name == "env":
            raise AttributeError(name)
        return getattr(self.env, name)

    def reset(self, seed=None, stream: str | int | None = None):
        """``stream`` names an independent draw sequence for the same seed (the runtime passes the
        group member and attempt, so members of a GRPO group and retries do not share one fate)."""
        self._closed.clear()
        self._ready = False
        self._seed, self._calls, self._reset_s, self._total_s = seed, 0, 0.0, 0.0
        if stream is not None:
            self._repeat = stream
        else:
            self._repeat = _next_repeat(self.spec, seed) if self.spec.redraw_repeats else 0
        slept = self._inject()
        self._reset_s = slept
        obs, info = self.env.reset(seed=seed)
        self._ready = True
        return obs, self._label(info, reset_s=slept, step_s=0.0)

    def step(self, action):
        if not self._ready:
            raise RuntimeError("Injected.step before a successful reset")
        slept = self._inject()
        obs, reward, terminated, truncated, info = self.env.step(action)
        return obs, reward, terminated, truncated, self._label(info, reset_s=self._reset_s, step_s=slept)

    def close(self):
        self._closed.set()
        self.env.close()

    def describe(self) -> dict:
        """The spec as JSON-serialisable data, marked emulated (for a flow's recorded output)."""
        d = self.spec.model_dump(mode="json")
        for key in ("reset_latency", "step_latency"):
            lat = getattr(self.spec, key)
            if isinstance(lat, EmpiricalLatency):
                d[key].update(path=str(lat.path), n=len(lat._points))
        return {"emulated": True, "wrapper": "rollart_dask.envs.inject.Injected", "inner": type(self.env).__qualname__, **d}

    def _inject(self) -> float:
        index = self._calls
        self._calls += 1
        d = draw(self.spec, self._seed, index, self._repeat)
        scale = self.spec.time_scale
        slept = d.latency_s * scale
        if slept > 0:
            self._sleep(slept)
        where = f"{d.call} (spec seed {self.spec.seed}, episode seed {self._seed}, call {index})"
        if d.hang:
            self._sleep(self.spec.hang_s * scale)
            raise InjectedFailure(f"emulated hang injected into env {where}: {self.spec.hang_s * scale:g} s, or until close()")
        if d.fail:
            p = self.spec.reset_fail if d.call == "reset" else self.spec.step_fail
            raise InjectedFailure(f"emulated failure injected into env {where} at rate {p:g}")
        if self._closed.is_set() and d.call == "step":  # closed while sleeping: the inner env is gone
            raise InjectedFailure(f"env closed during injected latency of {where}")
        self._total_s += slept
        return slept

    def _label(self, info, reset_s: float, step_s: float) -> dict:
        info = dict(info or {})
        info["injected"] = {
            "emulated": True,
            "reset_s": reset_s,
            "step_s": step_s,
            "total_s": self._total_s,
            "call": self._calls - 1,
            "spec_seed": self.spec.seed,
        }
        return info


def injected(inner: str, inject: dict | None = None, **inner_kwargs) -> Injected:
    """Env entry usable by name from a flow: ``env: "rollart_dask.envs.inject:injected"`` with env_args
    ``{inner: "rollart_dask.envs.frozenlake:FrozenLakeText", inject: {...spec...}, size: 4}``.
    ``inner`` is "module:attr" (registered short names live in the runtime, which envs/ does not import)."""
    module, sep, attr = inner.partition(":")
    if not sep:
        raise ValueError(f"inner env must be 'module:attr', got {inner!r}")
    return Injected(getattr(importlib.import_module(module), attr)(**inner_kwargs), inject)
