"""The dashboard's private API: a Bokeh page added to a running scheduler's dashboard, or listed before it starts.

distributed builds its own Bokeh app once, when the scheduler starts, from
``distributed.dashboard.scheduler.applications``; a page that arrives later is a second Bokeh app on the same HTTP
server: the server's RoutingApplication tries its applications in turn, so the new path reaches it while
everything else still reaches Dask's. Bokeh is imported here only where a function is called (on the scheduler).
"""

from __future__ import annotations


def add_bokeh_page(scheduler, path: str, make_doc):
    """Serve ``make_doc(scheduler, extra, doc)`` at ``<dashboard>path``, with Dask's navigation bar listing it; the app
    (None: already served). RuntimeError naming what is missing."""
    try:
        from bokeh.server.tornado import BokehTornado
        from distributed.dashboard.core import BokehApplication
        from distributed.dashboard.scheduler import template_variables
    except ImportError as e:
        raise RuntimeError(f"the scheduler cannot serve the page {path} ({e}); install bokeh>=3.1 where the scheduler runs") from None
    from tornado.ioloop import IOLoop

    http = getattr(scheduler, "http_application", None)
    dask_app = next((a for a in getattr(http, "applications", ()) if isinstance(a, BokehTornado)), None)
    if dask_app is None:
        raise RuntimeError("the scheduler runs without its dashboard: no page to add to")
    if any(path in getattr(a, "app_paths", ()) for a in http.applications):
        return None
    variables = dict(template_variables(scheduler))
    variables["pages"] = [*variables["pages"], path.strip("/")]
    app = BokehApplication({path: make_doc}, scheduler, prefix=dask_app.prefix, template_variables=variables)
    http.add_application(app)
    app.initialize(IOLoop.current())
    app.start()
    return app


def remove_bokeh_page(scheduler, app) -> None:
    if app is None or scheduler is None:
        return
    apps = scheduler.http_application.applications
    if app in apps:
        apps.remove(app)
    app.stop()


def list_page_at_start(path: str, make_doc) -> bool:
    """Add a page to the apps distributed builds when the scheduler starts (a preload's import); False without Bokeh."""
    try:
        from distributed.dashboard import scheduler as dashboard
    except ImportError:
        return False
    dashboard.applications.setdefault(path, make_doc)
    return True


def dask_look(doc, extra: dict) -> None:
    """Dask's page template and theme on ``doc``."""
    from distributed.dashboard.components.scheduler import BOKEH_THEME, env

    doc.template = env.get_template("simple.html")
    doc.template_variables.update(extra)
    doc.theme = BOKEH_THEME
