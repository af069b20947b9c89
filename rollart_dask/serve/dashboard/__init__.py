"""The RollArt page of the Dask dashboard (``<dashboard>/rollart``): trajectories in flight by stage,
busy fraction per pool, staleness, the policy version with its Suspend/Update/Resume, aborted /
dropped / failed counts and held-out scores, live while a run goes on.

Data path: the run builds a snapshot of its state about once a second (control/snapshot.py, pure)
and publishes it with ``client.log_event(TOPIC, snapshot)``; the ``RollartDashboard`` scheduler
plugin, registered when the run starts (entry/api.py), merges what arrives and the page reads it. ``log_event`` is
Dask's own channel: it needs no handler of ours on the scheduler, so publishing never fails where
the plugin could not be installed; the scheduler keeps the last events of the topic (bounded), so
a plugin registered mid-run catches up, and a notebook can read them with
``client.get_events("rollart")``.
"""

from __future__ import annotations

import asyncio

from rollart_dask.control.snapshot import TOPIC
from rollart_dask.serve.dashboard.plugin import PLUGIN, RollartDashboard

__all__ = ["PLUGIN", "TOPIC", "RollartDashboard", "page_url", "register"]


def page_url(dashboard_link: str | None) -> str | None:
    """``http://host:8787/status`` → ``http://host:8787/rollart``."""
    if not dashboard_link:
        return None
    base = dashboard_link[: -len("/status")] if dashboard_link.endswith("/status") else dashboard_link.rstrip("/")
    return f"{base}/rollart"


async def register(client) -> tuple[str | None, str | None]:
    """Install the plugin and its page on the client's scheduler: (page URL, None) or (None, why not).
    A run goes on without its page: the scheduler may lack rollart_dask or bokeh."""
    try:
        await asyncio.wait_for(client.register_plugin(RollartDashboard(), name=PLUGIN), 30)
    except Exception as e:
        return None, f"{type(e).__name__}: {e}"
    return page_url(client.dashboard_link), None
