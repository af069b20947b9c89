"""Dask spans for the run: each training step and each phase of the protocol is a span, so the
dashboard's fine performance metrics (and ``scheduler.extensions["spans"]``) attribute worker time
to ("rollart", "step-12", "train"), ("rollart", "rollout"), ("rollart", "eval") …

A span is a Dask annotation held in a context variable: every task the client submits while it is
set carries it, whether the submit runs in this coroutine or in a task created inside the context
(asyncio copies the context at task creation). A span's annotation can be captured once and
re-entered later (same ids, so the same span on the scheduler): that is how the phases of one step,
entered from different methods, all nest under that step's span.
"""
from __future__ import annotations

from contextlib import contextmanager

import dask
from distributed import span


def new_span(*tags: str, parent: dict | None = None) -> dict:
    """A fresh span's annotation (nested in ``parent``, else in the current span), to enter later with ``within``."""
    with within(parent), span(*tags):
        return dask.get_annotations()["span"]


@contextmanager
def within(annotation: dict | None):
    """Submit inside the span ``annotation`` (a no-op for None)."""
    if annotation is None:
        yield
        return
    with dask.annotate(span=annotation):
        yield


@contextmanager
def phase(step: dict | None, name: str):
    """The phase ``name`` inside ``step`` (a step's span, or the run's before the first step; None = outside a run)."""
    with within(step), span(name) if step is not None else span("rollart", name):
        yield


def first_caller_span() -> dict | None:
    """The span annotation in force now (to submit a coalesced batch later under its first caller's span)."""
    return dask.get_annotations().get("span")


def current_span_id() -> str | None:
    """The id of the span tasks submitted now would join (None outside any span)."""
    ann = dask.get_annotations().get("span")
    return ann["ids"][-1] if ann else None
