"""The runs' live figures on the Dask scheduler's own /metrics (Prometheus text), scraped while a run goes on;
every series the Grafana dashboard in deploy/monitoring queries is among them. And the RollArt page listed where
JupyterLab's Dask extension looks (the scheduler preload)."""

import json
import re
import time
import urllib.request
from pathlib import Path

from distributed import Client
from prometheus_client.parser import text_string_to_metric_families

import rollart_dask
from tests.conftest import flow_dict

GRAFANA = Path(__file__).resolve().parents[1] / "deploy" / "monitoring" / "grafana-rollart.json"


def scrape(url: str) -> dict[str, list]:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    out: dict[str, list] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append(s)
    return out


def test_a_scrape_of_the_schedulers_metrics_during_a_run_returns_the_rollart_series(address, tmp_path):
    flow = flow_dict(**{"trainer.steps": 10_000, "eval.every": 2, "rollout.redundancy": 1})
    wanted = set(re.findall(r"rollart_[a-z_]+", GRAFANA.read_text())) | {"rollart_up", "rollart_held_out_version"}
    with Client(address) as client:
        url = client.dashboard_link.rsplit("/", 1)[0] + "/metrics"
        run = rollart_dask.launch(flow, client=client, out=tmp_path / "run")
        try:
            t0, series = time.monotonic(), {}
            while True:
                assert run.status in ("starting", "running"), run.error
                assert time.monotonic() - t0 < 300, f"after 300 s the scrape still lacks {sorted(wanted - set(series))}"
                time.sleep(1.0)
                series = {
                    name: [s for s in samples if s.labels.get("run") == run.run_id]
                    for name, samples in scrape(url).items()
                    if name.startswith("rollart_")
                }
                version = [s.value for s in series.get("rollart_version", [])]
                held = [s.value for s in series.get("rollart_held_out_version", [])]
                if wanted <= {n for n, v in series.items() if v} and version and version[0] >= 3 and held and held[0] >= 2:
                    break
        finally:
            run.stop(timeout=240)
    assert "dask_scheduler_workers" in scrape(url)  # Dask's own series, from the same endpoint
    # the preloaded page is among the panes JupyterLab's Dask extension lists, and it serves
    base = url.rsplit("/", 1)[0]
    plots = json.loads(urllib.request.urlopen(base + "/individual-plots.json", timeout=10).read())
    assert plots.get("Individual Rollart") == "/individual-rollart", plots
    assert urllib.request.urlopen(base + "/individual-rollart", timeout=30).status == 200
    one = lambda name: series[name][0]  # noqa: E731
    assert one("rollart_up").labels == {"run": run.run_id, "flow": "test", "status": "running"} and one("rollart_up").value == 1
    assert one("rollart_turns_total").value > 0 and one("rollart_reward_calls_total").value > 0
    assert {s.labels["task"] for s in series["rollart_held_out_success"]} == {"frozenlake"}
    assert {s.labels["outcome"] for s in series["rollart_trajectories_total"]} >= {"finished", "redundant_dropped"}
    assert {s.labels["pool"] for s in series["rollart_pool_busy"]} >= {"H800", "CPU", "TRAIN"}
    assert sum(s.value for s in series["rollart_staleness_samples"]) > 0
    dashboard = json.loads(GRAFANA.read_text())
    assert dashboard["panels"] and all(t["expr"] for p in dashboard["panels"] for t in p["targets"])
