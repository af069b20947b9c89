"""Keep a real run here as a `rollart report` sample: its flow.yaml and summary.json as they are, its metrics.jsonl
gzipped with each row cut to the keys the report reads (the rest — stage latencies, mix, token lag … — and float
digits past four significant ones are dropped to keep the repository small; every row is kept).

    python docs/report-runs/archive.py runs/qs docs/report-runs/quickstart
    python docs/report-runs/archive.py runs/svr/sync docs/report-runs/sync_vs_rollart/sync   # likewise rollart

The runs kept here: `rollart run flows/quickstart.yaml` and `benchmarks/sync_vs_rollart.py --minutes 4` (its two runs).
"""

import gzip
import json
import shutil
import sys
from pathlib import Path

READ = {
    "time",
    "kind",
    "step",
    "version",
    "elapsed_s",
    "eval",
    "reward_mean",
    "success",
    "tasks",
    "staleness",
    "lag_hist",
    "reward",
    "pool_busy",
    "buffer",
    "reissued",
    "get_batch_s",
    "suspend_s",
    "update_s",
    "recompute_kv_s",
    "train_s",
    "wait_train_s",
    "weights",
    "entropy",
    "approx_kl",
    "clip_frac",
}


def short(value):
    if isinstance(value, float):
        return float(f"{value:.4g}")
    if isinstance(value, dict):
        return {k: short(v) for k, v in value.items()}
    if isinstance(value, list):
        return [short(v) for v in value]
    return value


def main(run: Path, into: Path) -> None:
    into.mkdir(parents=True, exist_ok=True)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").open() if line.strip()]
    kept = [{k: (round(v, 2) if k == "time" else short(v)) for k, v in r.items() if k in READ} for r in rows]
    (into / "metrics.jsonl.gz").write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in kept).encode(), 9, mtime=0))
    for name in ("flow.yaml", "summary.json"):
        shutil.copyfile(run / name, into / name)  # both: a run that has not finished is no sample
    print(f"{run} → {into}: {len(rows)} rows, {(into / 'metrics.jsonl.gz').stat().st_size / 1024:.0f} KiB")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
