"""Experiment trackers (``observe.loggers``): TensorBoard, W&B, MLflow, one class each with the same two calls.

MetricsWriter (observe.py) writes metrics.jsonl itself and hands every row to each tracker: ``log(row)``
plots the row's numeric leaves at its ``step``; ``close(final_checkpoint)`` ends the tracker's run, with
the final checkpoint as an artefact where the tracker keeps files. Each tracker records the effective flow
as its run's config when it starts. wandb and mlflow are optional extras, imported only when named.
"""

from __future__ import annotations

import importlib
import os
import re
import time
from pathlib import Path

import yaml

from rollart_dask.config import FlowError, ObserveConfig

SKIPPED = ("time", "step")  # every row has them: the wall clock and the x axis, not series


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "/"))
        else:
            out[key] = v
    return out


def scalars(row: dict) -> dict[str, float]:
    """A row's numeric leaves (bools as 0/1), keys joined with "/": what every tracker plots, at ``row["step"]``.
    An eval row's incomplete evaluation gives no success or reward (its failed_calls and completed instead)."""
    if row.get("kind") == "eval" and isinstance(row.get("eval"), dict):
        from rollart_dask.algo.heldout import loggable

        row = {**row, "eval": {t: loggable(f) if isinstance(f, dict) else f for t, f in row["eval"].items()}}
    return {k: float(v) for k, v in _flatten(row).items() if isinstance(v, (int, float)) and k not in SKIPPED}


def _extra(name: str):
    try:
        return importlib.import_module(name)
    except ImportError:
        raise FlowError(f"observe.loggers names {name}, which is not installed: pip install 'rollart-dask[{name}]'") from None


class TensorBoard:
    def __init__(self, out: Path, observe: ObserveConfig, flow: dict):
        from torch.utils.tensorboard import SummaryWriter

        self.w = SummaryWriter(str(out / "tensorboard"))
        # indented: TensorBoard renders text as Markdown, and an indented block keeps the YAML as it is
        self.w.add_text("flow", "    " + yaml.safe_dump(flow, sort_keys=False).replace("\n", "\n    "))

    def log(self, row: dict) -> None:
        step = int(row.get("step", 0))
        for k, v in scalars(row).items():
            self.w.add_scalar(k, v, step)

    def close(self, final_checkpoint: Path | None) -> None:  # (TensorBoard keeps no files but its own)
        self.w.close()


class Wandb:
    def __init__(self, out: Path, observe: ObserveConfig, flow: dict):
        wandb = self.wandb = _extra("wandb")
        o = observe.wandb
        # create_new: runs of several flows in one process (the Python API, ablations) each get their own W&B run;
        # console off: the run's own console (progress bar, summary) stays as it is
        self.run = wandb.init(
            project=o.project,
            entity=o.entity,
            mode=o.mode,
            dir=str(out),
            name=flow.get("name"),
            config=flow,
            reinit="create_new",
            settings=wandb.Settings(console="off"),
        )
        self.name = re.sub(r"[^\w.-]", "-", str(flow.get("name", "flow")))
        self.artifacts = observe.checkpoint_artifact
        # steps are policy versions, and an evaluation of the engines' version comes after the next step's row: a step
        # axis of our own, since W&B's own _step must only grow
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def log(self, row: dict) -> None:
        values = scalars(row)
        if values:
            self.run.log({"step": int(row.get("step", 0)), **values})

    def close(self, final_checkpoint: Path | None) -> None:
        if final_checkpoint is not None and self.artifacts:
            art = self.wandb.Artifact(f"{self.name}-checkpoint", type="model", metadata={"path": str(final_checkpoint)})
            art.add_dir(str(final_checkpoint), policy="immutable")  # (immutable: no staging copy of a checkpoint of GBs)
            self.run.log_artifact(art)
        self.run.finish()


PARAM_VALUE, PARAM_KEY = 500, 250  # MLflow's limits (the value limit of older servers and Databricks; newer allow more)
BAD_KEY = re.compile(r"[^\w./\- ]")  # a character MLflow refuses in a key (on some platform): "_" instead, not a failed batch


def _leaves(d, prefix: str = "") -> dict:
    """Every leaf of a nested dict/list, keys joined with "/" (list items by index): MLflow params are flat strings."""
    items = d.items() if isinstance(d, dict) else enumerate(d)
    out = {}
    for k, v in items:
        key = f"{prefix}{k}"
        out.update(_leaves(v, key + "/") if isinstance(v, (dict, list)) and v else {key: v})
    return out


class Mlflow:
    def __init__(self, out: Path, observe: ObserveConfig, flow: dict):
        _extra("mlflow")
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        self.Metric, self.out, self.artifacts = Metric, out, observe.checkpoint_artifact
        uri = observe.mlflow.tracking_uri or (out / "mlruns").resolve().as_uri()
        if uri.startswith("file:") or "://" not in uri:
            # MLflow 3 keeps the file store behind an opt-in (it recommends a database); the run's own directory is the point here
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = c = MlflowClient(uri)
        exp = c.get_experiment_by_name(observe.mlflow.experiment)
        eid = exp.experiment_id if exp is not None else c.create_experiment(observe.mlflow.experiment)
        self.run_id = c.create_run(eid, run_name=flow.get("name"), tags={"rollart.out": str(out.resolve())}).info.run_id
        # params: what fits MLflow's limits (a longer value cut, with "…"); the whole flow goes as flow.yaml
        params = [
            Param(k, s if len(s) <= PARAM_VALUE else s[: PARAM_VALUE - 1] + "…")
            for k, s in ((BAD_KEY.sub("_", k), str(v)) for k, v in _leaves(flow).items())
            if len(k) <= PARAM_KEY
        ]
        for i in range(0, len(params), 100):  # (MLflow takes 100 params per batch)
            c.log_batch(self.run_id, params=params[i : i + 100])
        c.log_text(self.run_id, yaml.safe_dump(flow, sort_keys=False), "flow.yaml")

    def log(self, row: dict) -> None:
        ms, step = int(row.get("time", time.time()) * 1000), int(row.get("step", 0))
        metrics = [self.Metric(BAD_KEY.sub("_", k), v, ms, step) for k, v in scalars(row).items()]
        for i in range(0, len(metrics), 1000):  # (and 1000 metrics)
            self.client.log_batch(self.run_id, metrics=metrics[i : i + 1000])

    def close(self, final_checkpoint: Path | None) -> None:
        if (self.out / "flow.yaml").exists():  # the effective flow the entry point wrote (engine backend, layout)
            self.client.log_artifact(self.run_id, str(self.out / "flow.yaml"))
        if final_checkpoint is not None and self.artifacts:
            self.client.log_artifacts(self.run_id, str(final_checkpoint), "checkpoint")
        self.client.set_terminated(self.run_id)


TRACKERS = {"tensorboard": TensorBoard, "wandb": Wandb, "mlflow": Mlflow}
