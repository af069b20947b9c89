"""A Python flow file: `rollart run flows/declared/corridor_flow.py` (with --set as for a YAML flow).

It builds the typed config in code; the env and reward it names are declared in corridor.py, next
to it, with their placement (the task below sets no affinity: the env's decorator decides it).
Like an ``imports`` file, this file is imported by the workers too: it only defines ``flow``.
"""

from pathlib import Path

import yaml

from rollart_dask.config import FlowConfig, TaskConfig

QUICKSTART = Path(__file__).resolve().parents[1] / "quickstart.yaml"  # its cluster, model and trainer settings


def flow() -> FlowConfig:
    base = yaml.safe_load(QUICKSTART.read_text())
    return FlowConfig(
        **{
            **base,
            "name": "declared",
            "imports": ["corridor.py"],
            "tasks": [TaskConfig(name="corridor", env="corridor", env_args={"length": 8}, reward="corridor", max_turns=8, max_tokens=2)],
            "reward": {"mode": "serverless"},
            "trainer": {**base["trainer"], "max_minutes": 6},
        }
    )
