"""observe.loggers: every tracker holds what metrics.jsonl holds, read back from its own files (no cluster).

MetricsWriter is driven with rows like a run's (step rows with nested dicts, an evaluation of the engines'
version after the next step's row, a placement row with a list), then closed with a final checkpoint.
W&B runs offline and is read back from its .wandb file (a LevelDB-format log of protobuf records); MLflow
from its file store through MlflowClient.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import struct
import sys
from collections import Counter

import pytest
import yaml

from rollart_dask.config import FlowError, load_flow
from rollart_dask.observe import MetricsWriter

# (not imported here: MLflow starts its telemetry on import, before the fixture below turns it off)
pytestmark = pytest.mark.skipif(
    not all(importlib.util.find_spec(m) for m in ("wandb", "mlflow")),
    reason="the wandb and mlflow extras: pip install -e '.[wandb,mlflow]'",
)

TASK = {"name": "frozenlake", "env": "frozenlake", "reward": "frozenlake"}

ROWS = [
    {"kind": "eval", "step": 0, "version": 0, "eval": {"frozenlake": {"success": 0.25, "reward": 0.5, "n": 200}}, "eval_s": 1.5},
    {
        "kind": "step",
        "step": 1,
        "version": 1,
        "reward": {"mean": 0.125, "frozenlake": 0.125},
        "staleness": {"max": 1, "mean": 0.5},
        "get_batch_s": 0.75,
        "weights": {"pull_s": 0.01, "bytes": 1024},
        "loss": -0.03,
        "note": "not a number",
        "ok": True,
    },
    {
        "kind": "step",
        "step": 2,
        "version": 2,
        "reward": {"mean": 0.375, "frozenlake": 0.375},
        "staleness": {"max": 1, "mean": 1.0},
        "get_batch_s": 0.5,
        "loss": 0.02,
        "ok": False,
    },
    # the engines' version is evaluated after the trainer published the next one: a step below the last row's
    {"kind": "eval", "step": 1, "version": 1, "eval": {"frozenlake": {"success": 0.5, "reward": 0.75, "n": 200}}, "eval_s": 1.25},
    {"kind": "placement", "step": 2, "mapping": {"frozenlake": "H800"}, "predicted_step_s": 3.5, "ranking": [["a", 1.0]]},
]


def triples_of_jsonl(path) -> Counter:
    """(step, key, value) for every numeric leaf of every row, keys "/"-joined, time and step left out (a multiset: a
    step and an evaluation at one step both have a version)."""
    out = Counter()

    def walk(d, prefix, step):
        for k, v in d.items():
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}/", step)
            elif isinstance(v, (int, float)) and f"{prefix}{k}" not in ("time", "step"):
                out[step, f"{prefix}{k}", float(v)] += 1

    for line in path.read_text().splitlines():
        row = json.loads(line)
        walk(row, "", row["step"])
    return out


def wandb_records(path):
    """The protobuf records of a .wandb file: a ":W&B" header, then LevelDB log blocks of 32 KiB (records split across them)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, chunk = 7, b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:  # zeros: the rest of the block is padding
            pos += left
            continue
        chunk += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL, or the LAST piece of a FIRST, MIDDLE…, LAST record
            record = pb.Record()
            record.ParseFromString(chunk)
            chunk = b""
            yield record


def read_wandb(out):
    (run_file,) = out.glob("wandb/offline-run-*/run-*.wandb")
    triples, config, artifacts = Counter(), {}, {}
    for r in wandb_records(run_file):
        kind = r.WhichOneof("record_type")
        if kind == "history":
            row = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item}
            triples.update((row["step"], k, float(v)) for k, v in row.items() if not k.startswith("_") and k != "step")
        elif kind == "run":
            config = {i.key: json.loads(i.value_json) for i in r.run.config.update if i.key != "_wandb"}
        elif kind == "artifact":
            artifacts[r.artifact.name] = (r.artifact.type, {c.path for c in r.artifact.manifest.contents})
    return triples, config, artifacts


def read_mlflow(out):
    from mlflow.tracking import MlflowClient

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # (MLflow 3 opens a file store only when told to)
    c = MlflowClient((out / "mlruns").resolve().as_uri())
    (run,) = c.search_runs([c.get_experiment_by_name("rollart").experiment_id])
    rid = run.info.run_id
    triples = Counter((m.step, m.key, m.value) for key in run.data.metrics for m in c.get_metric_history(rid, key))
    files = {f.path for f in c.list_artifacts(rid)}
    ckpt = set()
    todo = ["checkpoint"]
    while todo:  # the artefact tree, walked
        for f in c.list_artifacts(rid, todo.pop()):
            (todo.append(f.path) if f.is_dir else ckpt.add(f.path.removeprefix("checkpoint/")))
    flow_yaml = yaml.safe_load((out / "mlruns" / run.info.experiment_id / rid / "artifacts" / "flow.yaml").read_text())
    return triples, run.data.params, files, ckpt, flow_yaml, run.info.status


def flat_params(d, prefix="") -> dict:
    out = {}
    for k, v in d.items() if isinstance(d, dict) else enumerate(d):
        if isinstance(v, (dict, list)) and v:
            out.update(flat_params(v, f"{prefix}{k}/"))
        else:
            out[f"{prefix}{k}"] = str(v)
    return out


def isolation(tmp_path) -> dict:
    """W&B offline, its caches and settings in tmp_path; MLflow without telemetry: nothing read from or written to the home directory."""
    env = {
        var: str(tmp_path / sub)
        for var, sub in (
            ("WANDB_DIR", "wandb-dir"),
            ("WANDB_CACHE_DIR", "cache"),
            ("WANDB_CONFIG_DIR", "config"),
            ("WANDB_DATA_DIR", "data"),
        )
    }
    # (MLFLOW_DISABLE_TELEMETRY: nor a usage report sent, nor its id file under ~/.config)
    return {**env, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "MLFLOW_DISABLE_TELEMETRY": "true"}


UNSET = ("WANDB_API_KEY", "MLFLOW_TRACKING_URI")


def isolated_env(tmp_path) -> dict:
    """The environment of a subprocess, isolated so."""
    return {k: v for k, v in os.environ.items() if k not in UNSET} | isolation(tmp_path)


@pytest.fixture
def isolated(tmp_path, monkeypatch):
    for var, value in isolation(tmp_path).items():
        monkeypatch.setenv(var, value)
    for var in UNSET:
        monkeypatch.delenv(var, raising=False)
    return tmp_path


def test_every_tracker_holds_the_rows_the_flow_and_the_checkpoint(isolated):
    out = isolated / "run"
    out.mkdir()
    cfg = load_flow(
        data={"name": "trackers-test", "tasks": [TASK], "observe": {"loggers": ["tensorboard", "wandb", "mlflow"]}, "trainer": {"lr": 1e-3}}
    )
    flow = cfg.model_dump(mode="json")
    ckpt = out / "checkpoints" / "step-2"
    (ckpt / "sub").mkdir(parents=True)
    (ckpt / "model.safetensors").write_bytes(b"\0" * 64)
    (ckpt / "config.json").write_text("{}")
    (ckpt / "sub" / "trainer_state.pt").write_bytes(b"x")

    metrics = MetricsWriter(out, cfg.observe, flow)
    assert list(metrics.trackers) == ["tensorboard", "wandb", "mlflow"]
    for row in ROWS:
        metrics.write(row)
    (out / "flow.yaml").write_text(yaml.safe_dump({**flow, "_effective": {"engine_backend": "torch"}}, sort_keys=False))
    metrics.close(str(ckpt))
    assert metrics.trackers == {}, "a tracker failed (see the warning above)"

    expected = triples_of_jsonl(out / "metrics.jsonl")
    assert sum(expected.values()) == 29 and expected[1, "version", 1.0] == 2 and expected[1, "ok", 1.0] == 1
    assert (1, "eval/frozenlake/success", 0.5) in expected  # (the evaluation logged after the step-2 row)
    files = {"model.safetensors", "config.json", "sub/trainer_state.pt"}

    w_triples, w_config, w_artifacts = read_wandb(out)
    assert w_triples == expected
    assert w_config == flow
    assert w_artifacts == {"trackers-test-checkpoint": ("model", files)}

    m_triples, params, m_files, m_ckpt, m_flow, status = read_mlflow(out)
    assert m_triples == expected
    assert params == flat_params(flow)
    assert params["trainer/lr"] == "0.001" and params["tasks/0/name"] == "frozenlake" and params["observe/loggers/1"] == "wandb"
    assert {"flow.yaml", "checkpoint"} <= m_files and m_ckpt == files
    assert m_flow["_effective"] == {"engine_backend": "torch"}  # the file the entry point wrote, in the end
    assert status == "FINISHED"

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "tensorboard"), purge_orphaned_data=False)  # (keep a step below the last, as W&B does)
    acc.Reload()
    tb = sorted((e.step, tag, e.value) for tag in acc.Tags()["scalars"] for e in acc.Scalars(tag))
    assert len(tb) == sum(expected.values())
    assert all(a[:2] == b[:2] and math.isclose(a[2], b[2], rel_tol=1e-6) for a, b in zip(tb, sorted(expected.elements())))  # (float32)


def test_a_run_without_trackers_writes_only_metrics_jsonl(isolated):
    out = isolated / "run"
    out.mkdir()
    cfg = load_flow(data={"tasks": [TASK], "observe": {"tensorboard": False}})
    metrics = MetricsWriter(out, cfg.observe, cfg.model_dump(mode="json"))
    metrics.write(ROWS[1])
    metrics.close(None)
    assert sorted(p.name for p in out.iterdir()) == ["metrics.jsonl"]


def test_a_tracker_that_fails_is_left_out_and_the_rest_go_on(isolated, capsys):
    out = isolated / "run"
    out.mkdir()
    cfg = load_flow(data={"tasks": [TASK], "observe": {"loggers": ["mlflow"]}})
    metrics = MetricsWriter(out, cfg.observe, cfg.model_dump(mode="json"))
    metrics.trackers["mlflow"].log = lambda row: 1 / 0
    metrics.write(ROWS[1])
    metrics.write(ROWS[2])
    metrics.close(None)
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2
    assert "mlflow failed (ZeroDivisionError" in capsys.readouterr().err


def observe_error(observe: dict) -> str:
    with pytest.raises(FlowError) as e:
        load_flow(data={"tasks": [TASK], "observe": observe})
    return str(e.value)


def test_tensorboard_and_loggers_agree_or_the_flow_is_refused():
    def observe(o: dict, overrides=()):
        c = load_flow(data={"tasks": [TASK], "observe": o}, overrides=list(overrides)).observe
        return c.tensorboard, c.loggers

    assert observe({}) == (True, ["tensorboard"])
    assert observe({"tensorboard": False}) == (False, [])  # the flows written before loggers
    assert observe({"loggers": ["wandb", "mlflow"]}) == (False, ["wandb", "mlflow"])
    assert observe({"tensorboard": True, "loggers": ["mlflow", "tensorboard"]}) == (True, ["mlflow", "tensorboard"])
    assert observe({"loggers": ["wandb"]}, ["observe.tensorboard=false"]) == (False, ["wandb"])

    msg = observe_error({"tensorboard": False, "loggers": ["tensorboard", "wandb"]})
    assert "observe.tensorboard is false but observe.loggers names tensorboard" in msg
    msg = observe_error({"tensorboard": True, "loggers": ["wandb"]})
    assert "observe.tensorboard is true but observe.loggers leaves out tensorboard" in msg
    assert "observe.loggers.0: bad value 'neptune': input should be 'tensorboard', 'wandb' or 'mlflow'" in observe_error(
        {"loggers": ["neptune"]}
    )
    assert "each logger once" in observe_error({"loggers": ["wandb", "wandb"]})
    assert "observe.wandb.mode: bad value 'cloud'" in observe_error({"wandb": {"mode": "cloud"}})
    assert "observe.mlflow.uri: unknown key (allowed: experiment, tracking_uri)" in observe_error({"mlflow": {"uri": "x"}})


def test_the_effective_flow_records_loggers_and_loads_again_as_rollart_eval_loads_it(tmp_path):
    """flow.yaml (model_dump) keeps loggers, not the older key; `rollart eval` turns every tracker off on it, old or new."""
    from rollart_dask.entry.evaluate import eval_flow

    cfg = load_flow(data={"tasks": [TASK], "observe": {"tensorboard": False, "loggers": ["wandb"]}})
    dumped = cfg.model_dump(mode="json")
    assert "tensorboard" not in dumped["observe"] and dumped["observe"]["loggers"] == ["wandb"]
    assert load_flow(data=dumped).observe.loggers == ["wandb"]
    for observe in (dumped["observe"], {"tensorboard": True}):  # (a run directory written before loggers: the older key only)
        (tmp_path / "flow.yaml").write_text(yaml.safe_dump({**dumped, "observe": observe}))
        assert eval_flow(tmp_path, []).observe.loggers == []


def test_a_logger_not_installed_names_its_extra(isolated, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # (what `import wandb` meets where it is not installed: ImportError)
    cfg = load_flow(data={"tasks": [TASK], "observe": {"loggers": ["wandb"]}})
    with pytest.raises(FlowError, match=r"observe.loggers names wandb, which is not installed: pip install 'rollart-dask\[wandb\]'"):
        MetricsWriter(isolated, cfg.observe, {})
