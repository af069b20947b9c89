"""`rollart check FLOW`: the run's pre-flight alone (control/preflight.py) on the flow's cluster: each task's env plays
one episode on an env worker and its reward is called on it where the run would call it. No model loads."""

from __future__ import annotations

from pathlib import Path

from rollart_dask.config import FlowConfig


async def preflight_flow(cfg: FlowConfig, out: Path) -> dict[str, dict]:
    """Each task's pre-flight ({turns, reward}); PreflightError (a FlowError) listing every problem found."""
    from rollart_dask.control import wiring
    from rollart_dask.control.dispatch import Dispatcher
    from rollart_dask.resource.cluster import connect
    from rollart_dask.serve.lambda_local import start_local_endpoint

    out.mkdir(parents=True, exist_ok=True)
    client, cluster = await connect(cfg.cluster)
    d = Dispatcher(client)
    made: dict = {}
    try:
        s = await wiring.wire(
            cfg, client, out, None, d, start_local_endpoint, on_weights=lambda w: made.setdefault("weights", w), until_preflight=True
        )
        made["rewards"] = s.rewards
        return s.preflight or {}
    finally:
        d.close()
        if "rewards" in made:
            made["rewards"].close()
        if "weights" in made:
            await made["weights"].close()
        await client.close()
        if cluster is not None:
            await cluster.close()
