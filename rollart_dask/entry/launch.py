"""The Python API for notebooks and scripts: ``run = rollart_dask.launch(flow)`` returns at once.

The run lives in a background thread with its own event loop (Dask's asynchronous client), so a
notebook kernel stays free; with ``client=`` it joins the scheduler of a ``distributed.Client``
the user already has, otherwise it starts the flow's cluster (the embedded one by default).
Steering calls (pause / resume / stop) are handed to the run's loop thread-safely.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

from rollart_dask.config import FlowConfig, FlowError, load_flow
from rollart_dask.config.schema import not_deterministic_attached


class RunHandle:
    """A running flow: ``status``, live ``metrics`` / ``evals`` (pandas), ``pause()``, ``resume()``,
    ``stop()`` (ends after the current step, publishes it, evaluates and checkpoints: nothing
    trained is lost), ``wait()`` / ``await run``, ``checkpoint_path``."""

    def __init__(self, cfg: FlowConfig, out: Path, resume: bool = False, security=None):
        self.cfg, self.out, self._security = cfg, Path(out), security
        self.result: dict | None = None
        self.error: BaseException | None = None
        self._run = None  # the loop's Run, once set up
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self._done = threading.Event()
        self._stop_early = False
        self._dashboard_link: str | None = None  # kept: the run's client is closed once it ends
        self._thread = threading.Thread(target=self._main, args=(resume,), name=f"rollart-{cfg.name}", daemon=True)
        self._thread.start()

    def _main(self, resume: bool) -> None:
        from rollart_dask.entry.api import run_flow

        def ready(run) -> None:
            self._run, self._loop = run, asyncio.get_running_loop()
            self._dashboard_link = run.client.dashboard_link
            if self._stop_early:
                run.request_stop()
            self._ready.set()

        try:
            self.result = asyncio.run(run_flow(self.cfg, self.out, resume=resume, on_ready=ready, security=self._security))
        except BaseException as e:  # reported by status / wait(), never swallowed
            self.error = e
        finally:
            self._ready.set()
            self._done.set()

    # -- state ----------------------------------------------------------------------------------
    @property
    def status(self) -> str:
        if self._done.is_set():
            return "failed" if self.error is not None else "finished"
        run = self._run
        if run is None:
            return "starting"
        return run.state

    def _rows(self, kind: str) -> list[dict]:
        run = self._run
        return [r for r in list(run.metrics.rows) if r["kind"] == kind] if run is not None else []

    @property
    def metrics(self):
        """One row per training step (nested keys flattened with dots); grows while the run goes on."""
        import pandas as pd

        return pd.json_normalize(self._rows("step"))

    @property
    def evals(self):
        """One row per held-out evaluation (``eval.<task>.success`` …)."""
        import pandas as pd

        return pd.json_normalize(self._rows("eval"))

    @property
    def dashboard_url(self) -> str | None:
        """The RollArt page of the Dask dashboard (trajectories, pools, staleness, versions live)."""
        return self._run.dashboard_url if self._run is not None else None

    @property
    def run_id(self) -> str | None:
        """The run's id on the scheduler: its dashboard snapshots and the ``run`` label of its rollart_* Prometheus series."""
        return self._run.run_id if self._run is not None else None

    @property
    def checkpoint_path(self) -> str | None:
        if self.result is not None:
            return self.result["checkpoint"]
        latest = self.out / "checkpoints" / "latest"
        return latest.read_text().strip() if latest.exists() else None

    # -- steering -------------------------------------------------------------------------------
    def _call(self, fn) -> None:
        if not self._ready.wait(timeout=600) or self._run is None:
            raise RuntimeError(
                f"run {self.cfg.name!r} is not running (status: {self.status})" + (f": {self.error!r}" if self.error else "")
            )
        self._loop.call_soon_threadsafe(fn)

    def pause(self) -> None:
        """No new trajectories; those in flight finish and finished groups still train."""
        self._call(lambda: self._run.pause())

    def resume(self) -> None:
        self._call(lambda: self._run.resume())

    def stop(self, wait: bool = True, timeout: float | None = None) -> dict | None:
        """End after the current step (drained: the pending train step is published, then the final
        evaluation and checkpoint); with ``wait`` returns the run's result."""
        if not self._ready.is_set():
            self._stop_early = True  # honoured as soon as set-up is done
        elif self._run is not None and not self._done.is_set():
            self._loop.call_soon_threadsafe(self._run.request_stop)
        return self.wait(timeout) if wait else None

    def wait(self, timeout: float | None = None) -> dict:
        if not self._done.wait(timeout):
            raise TimeoutError(f"run {self.cfg.name!r} still {self.status} after {timeout} s")
        if self.error is not None:
            raise self.error
        return self.result  # type: ignore[return-value]

    def __await__(self):
        return asyncio.get_running_loop().run_in_executor(None, self.wait).__await__()

    def _repr_html_(self) -> str:
        """The notebook view (like a distributed.Client's): flow, mode, pools, dashboard, progress."""
        from html import escape

        cfg, run = self.cfg, self._run
        r = cfg.rollout
        rows = [
            ("flow", cfg.name),
            ("status", self.status),
            ("mode", f"{r.mode} ({r.level} level), α={r.alpha}, G={r.group_size}, {r.batch_groups} groups/step"),
            ("tasks", ", ".join(t.name for t in cfg.tasks)),
            ("output", str(self.out)),
        ]
        if run is not None:
            link = self._dashboard_link
            if link:
                rows.append(("dashboard", f'<a href="{escape(link)}" target="_blank">{escape(link)}</a>'))
            if run.dashboard_url:
                rows.append(("rollart page", f'<a href="{escape(run.dashboard_url)}" target="_blank">{escape(run.dashboard_url)}</a>'))
            pools = {
                p: [run.services.poolmap.name(a) for a in run.services.poolmap.members(p)]
                for p in ("H800", "H20", "CPU", "TRAIN", "REWARD", "SERVERLESS")
            }
            rows.append(("pools", "; ".join(f"{p}: {', '.join(ws)}" for p, ws in pools.items() if ws)))
            steps = len(self._rows("step"))
            pct = 100.0 * steps / max(cfg.trainer.steps, 1)
            rows.append(
                ("steps", f'<progress value="{steps}" max="{cfg.trainer.steps}"></progress> {steps} / {cfg.trainer.steps} ({pct:.0f}%)')
            )
            evals = self._rows("eval")
            if evals:
                first, last = evals[0], evals[-1]
                from rollart_dask.algo.heldout import played_as, shown  # (an incomplete evaluation: its note, never a score)

                rows.append(
                    (
                        f"held-out ({played_as(last.get('temperature'))})",
                        ", ".join(
                            f"{t} {shown(first['eval'][t], 2) if t in first['eval'] else '—'} → {shown(e, 2)}"
                            for t, e in last["eval"].items()
                        ),
                    )
                )
        if self.error is not None:
            rows.append(("error", escape(repr(self.error))))
        cells = "".join(
            f"<tr><th style='text-align:left'>{escape(k)}</th><td style='text-align:left'>"
            f"{v if k in ('dashboard', 'rollart page', 'steps') else escape(v)}</td></tr>"
            for k, v in rows
        )
        return f"<div><strong>rollart-dask run</strong><table>{cells}</table></div>"

    def __repr__(self) -> str:
        steps = len(self._rows("step"))
        return f"<RunHandle {self.cfg.name!r} {self.status}: {steps} steps, out={self.out}>"


def launch(flow, client=None, out: str | Path | None = None, resume: bool = False, overrides: list[str] | tuple = (), **kw) -> RunHandle:
    """Start a flow in the background and return its handle at once.

    ``flow``: a path, a dict or a FlowConfig. ``client``: a ``distributed.Client`` whose scheduler
    the run joins (else the flow's cluster section decides). ``overrides``: ``["trainer.steps=50"]``;
    keyword overrides use ``__`` for dots: ``trainer__steps=50``.
    """
    over = [*overrides, *(f"{k.replace('__', '.')}={v}" for k, v in kw.items())]
    if isinstance(flow, FlowConfig):
        cfg = load_flow(data=flow.model_dump(mode="json"), overrides=over)
    elif isinstance(flow, dict):
        cfg = load_flow(data=flow, overrides=over)
    else:
        cfg = load_flow(str(flow), over)
    security = None
    if client is not None and cfg.rollout.deterministic:
        raise FlowError(not_deterministic_attached(f"a client's cluster ({client.scheduler.address})"))
    if client is not None:  # its scheduler, with its certificates when TLS
        security = client.security if client.scheduler.address.startswith("tls://") else None
        cfg.cluster.security = None
        cfg.cluster.scheduler = client.scheduler.address
    out = Path(out) if out is not None else Path("runs") / f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    return RunHandle(cfg, out, resume=resume, security=security)
