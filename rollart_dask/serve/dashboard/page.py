"""The Bokeh page at ``<dashboard>/rollart``, added to a running scheduler's dashboard with the run's plugin
(how: compat/dashboard.py). Bokeh is imported here only, on the scheduler.
"""

from __future__ import annotations

from html import escape

from rollart_dask.compat.dashboard import add_bokeh_page, dask_look, remove_bokeh_page
from rollart_dask.serve.dashboard.names import PLUGIN
from rollart_dask.serve.dashboard.panels import panel_data

PATH = "/rollart"
REFRESH_MS = 1000


def add_page(scheduler):
    """Serve the page from ``scheduler``'s dashboard; raises RuntimeError naming what is missing."""
    return add_bokeh_page(scheduler, PATH, rollart_doc)


def remove_page(scheduler, app) -> None:
    remove_bokeh_page(scheduler, app)


def summary_html(s: dict) -> str:
    """The header: what the run is doing, and per-panel totals as data attributes."""
    attrs = " ".join(f'data-{k.replace("_", "-")}="{escape(str(v))}"' for k, v in s.items())
    return (
        f'<div class="rollart-summary" {attrs} style="font-size:14px">'
        f"<b>RollArt</b> run <b>{escape(str(s['run']) or '–')}</b> · {escape(str(s['mode']))} α={escape(str(s['alpha']))} · "
        f"<b>{escape(str(s['status']))}</b> · step {s['step']} / {s['steps_target']} · engines v{s['version']} · "
        f"{s['inflight']} trajectories in flight · {s['finished']} finished · trained mix within {s['mix_shift_pp']:.1f} pp "
        f"of launched · t={s['t']:.0f}s</div>"
    )


def rollart_doc(scheduler, extra, doc):
    from bokeh.layouts import column, gridplot
    from bokeh.models import ColumnDataSource, Div, FactorRange, Range1d
    from bokeh.plotting import figure
    from bokeh.transform import dodge

    data = panel_data(None)
    src = {k: ColumnDataSource(v) for k, v in data.items() if k != "summary"}
    header = Div(text=summary_html(data["summary"]), sizing_mode="stretch_width")
    kw = {"height": 260, "sizing_mode": "stretch_width", "tools": "pan,wheel_zoom,box_zoom,reset,hover"}

    inflight = figure(title="Trajectories in flight by stage", x_range=FactorRange(*data["inflight"]["stage"]), **kw)
    inflight.vbar(x="stage", top="n", width=0.8, source=src["inflight"], color="#1f77b4")
    inflight.y_range.start = 0

    busy = figure(title="Busy fraction per pool (per step)", x_axis_label="run time (s)", y_range=Range1d(0, 1.05), **kw)
    busy.multi_line(xs="xs", ys="ys", color="color", legend_field="name", line_width=2, source=src["busy"])
    busy.scatter(x="x", y="y", color="color", size=5, source=src["busy_points"])
    busy.legend.location = "top_left"

    stale = figure(title="Staleness of trained trajectories (version at Train − start)", x_axis_label="staleness", **kw)
    stale.vbar(x="x", top="n", width=0.8, source=src["staleness"], color="#9467bd")
    stale.y_range.start = 0
    stale.xaxis.ticker.min_interval = 1

    lag = figure(title="Its two parts: versions in flight · in the queue (first token → finish → Train)", x_axis_label="versions", **kw)
    lag.vbar(x=dodge("x", -0.2), top="in_flight", width=0.4, source=src["lag"], color="#17becf", legend_label="in flight")
    lag.vbar(x=dodge("x", 0.2), top="in_queue", width=0.4, source=src["lag"], color="#bcbd22", legend_label="in the queue")
    lag.y_range.start = 0
    lag.xaxis.ticker.min_interval = 1
    lag.legend.location = "top_right"

    version = figure(title="Policy version of the engines: Suspend · Update · Resume", x_axis_label="run time (s)", **kw)
    version.step(x="t", y="version", mode="after", source=src["version"], line_width=2, color="#333333")
    version.segment(x0="x0", x1="x1", y0="y", y1="y", source=src["suspend"], line_width=10, color="#d62728", legend_label="suspend")
    version.segment(x0="x0", x1="x1", y0="y", y1="y", source=src["update"], line_width=10, color="#ff7f0e", legend_label="update")
    version.scatter(x="t", y="version", source=src["resume"], marker="triangle", size=9, color="#2ca02c", legend_label="resume")
    version.legend.location = "top_left"
    version.yaxis.ticker.min_interval = 1

    counts = figure(title="Aborted, dropped and failed trajectories", y_range=FactorRange(*data["counts"]["what"]), **kw)
    counts.hbar(y="what", right="n", height=0.7, source=src["counts"], color="#8c564b")
    counts.x_range.start = 0

    scores = figure(title="Held-out success per task", x_axis_label="policy version", y_range=Range1d(0, 1.05), **kw)
    scores.multi_line(xs="xs", ys="ys", color="color", legend_field="name", line_width=2, source=src["scores"])
    scores.scatter(x="x", y="y", color="color", size=6, source=src["scores_points"])
    scores.xaxis.ticker.min_interval = 1
    scores.legend.location = "top_left"

    mix = figure(title="Trained − launched share per task (percentage points, since the start)", x_axis_label="run time (s)", **kw)
    mix.multi_line(xs="xs", ys="ys", color="color", legend_field="name", line_width=2, source=src["mix"])
    mix.scatter(x="x", y="y", color="color", size=5, source=src["mix_points"])
    mix.legend.location = "top_left"

    def update() -> None:
        plugin = scheduler.plugins.get(PLUGIN)
        d = panel_data(plugin.current() if plugin is not None else None)
        if list(inflight.x_range.factors) != d["inflight"]["stage"]:
            inflight.x_range.factors = d["inflight"]["stage"]
        if list(counts.y_range.factors) != d["counts"]["what"]:
            counts.y_range.factors = d["counts"]["what"]
        for k, s in src.items():
            s.data = d[k]
        header.text = summary_html(d["summary"])

    update()
    doc.add_periodic_callback(update, REFRESH_MS)
    doc.title = "Dask: RollArt"
    doc.add_root(
        column(
            header,
            gridplot([[inflight, busy], [stale, lag], [version, counts], [scores, mix]], sizing_mode="stretch_width"),
            sizing_mode="stretch_width",
        )
    )
    dask_look(doc, extra)
