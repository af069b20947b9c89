"""A scheduler preload that lists the RollArt page in JupyterLab's Dask extension.

The extension lists the ``individual-*`` pages of distributed's own dashboard app (``individual-plots.json``),
an app built once, when the scheduler starts, from ``distributed.dashboard.scheduler.applications``. Preloads are
imported before that, so importing this module adds the page there as ``/individual-rollart``:
``dask scheduler --preload rollart_dask.serve.dashboard.preload`` (the embedded default and deploy/ recipes pass
it). The page the run's plugin adds at ``/rollart`` is the same page, on any scheduler, preloaded or not.
"""

from __future__ import annotations

from rollart_dask.compat.dashboard import list_page_at_start
from rollart_dask.serve.dashboard.page import rollart_doc

PATH = "/individual-rollart"

list_page_at_start(PATH, rollart_doc)  # (without Bokeh, Dask serves no dashboard to list it in: nothing is done)


def dask_setup(scheduler) -> None:  # (the preload protocol; all of it is done at import)
    pass
