"""Ablation files: which flow, which variants, which metric, and what the paper reports."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import Field, ValidationError

from rollart_dask.config import FlowError, Strict

ABLATIONS_DIR = Path(__file__).resolve().parents[3] / "flows" / "ablations"

# metric → (what it is, unit, True when higher is better)
METRICS = {
    "step_s": ("mean step time", "emulated s", False),
    "throughput": ("trajectories per emulated second", "traj/s", True),
    "rollout_s": ("mean trajectory rollout time (launch → reward)", "emulated s", False),
    "reward_utilisation": ("reward capacity utilisation (busy / provisioned)", "fraction", True),
    "reward_paid_utilisation": (
        "share of paid reward time spent scoring (local: = utilisation; serverless: handler / billed)",
        "fraction",
        True,
    ),
}
Metric = Literal["step_s", "throughput", "rollout_s", "reward_utilisation", "reward_paid_utilisation"]


def fraction(metric: str, measured: float | None, ideal: float | None) -> float | None:
    """Measured as a fraction of its ideal (1 = ideal): ideal/measured for times, measured/ideal for rates."""
    if not measured or not ideal:
        return None
    return measured / ideal if METRICS[metric][2] else ideal / measured


class Variant(Strict):
    name: str
    set: list[str] = Field(default_factory=list, description="flow overrides of this variant")


class AblationSpec(Strict):
    figure: str = Field(description="the paper's figure this reproduces, e.g. 'Fig. 13'")
    title: str
    flow: str = Field(description="the emulated flow, relative to this file")
    metric: Metric
    also: list[Metric] = Field(default_factory=list, description="further metrics reported")
    baseline: str | dict[str, str] = Field(
        description="the variant ratios are taken against, or variant → its own baseline (variants left out are compared with themselves)"
    )
    tasks: list[str] | None = Field(None, description="keep only these tasks of the flow (default: all)")
    set: list[str] = Field(default_factory=list, description="overrides for every variant")
    quick: list[str] = Field(default_factory=list, description="overrides added by --quick")
    tiny: list[str] = Field(default_factory=list, description="overrides added by --tiny (the test suite)")
    warmup_steps: int = Field(2, ge=0, description="steps left out of the measurement (pipeline fill)")
    paper: dict[str, float | None] = Field(
        default_factory=dict, description="variant → the paper's ratio against the baseline (speed-up; for utilisation the value itself)"
    )
    paper_note: str = Field("", description="where the paper's numbers come from and how to read them")
    variants: list[Variant]

    def baseline_of(self, name: str) -> str:
        return self.baseline if isinstance(self.baseline, str) else self.baseline.get(name, name)

    def variant(self, name: str) -> Variant:
        for v in self.variants:
            if v.name == name:
                return v
        raise FlowError(f"no variant {name!r}; variants: {[v.name for v in self.variants]}")


def ablation_names() -> list[str]:
    return sorted(p.stem for p in ABLATIONS_DIR.glob("*.yaml"))


def load_ablation(name_or_path: str) -> tuple[AblationSpec, Path]:
    path = Path(name_or_path)
    if not path.suffix:
        path = ABLATIONS_DIR / f"{name_or_path}.yaml"
    if not path.is_file():
        raise FlowError(f"unknown ablation {name_or_path!r}; known: {', '.join(ablation_names())} (or a path to an ablation YAML)")
    try:
        spec = AblationSpec.model_validate(yaml.safe_load(path.read_text()))
    except ValidationError as e:
        raise FlowError(f"{path}: " + "; ".join(f"{'.'.join(map(str, x['loc']))}: {x['msg']}" for x in e.errors())) from None
    for name in [spec.baseline] if isinstance(spec.baseline, str) else [*spec.baseline, *spec.baseline.values()]:
        spec.variant(name)
    return spec, path
