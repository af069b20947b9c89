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

import itertools
import uuid
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


_KEY_PREFIX = uuid.uuid4().hex[:6]  # this process's keys never meet another client's on a shared scheduler
_key_ids = itertools.count()


def task_key(stage: str):
    """A task's key, named by its stage: ``stage-<id>``, or inside a span ``("stage-<span id>", "<id>")``.

    The scheduler files a task under the span of its TaskGroup, and a string key's group is just the
    stage: the train task of step 12 would join the span of step 11's train task if that one is
    still alive. A group per (stage, span) keeps each step and phase in its own span; Dask's
    ``key_split`` of either form is still the stage, so the task stream colours and groups by stage.
    """
    token = f"{_KEY_PREFIX}{next(_key_ids):x}"
    span_id = current_span_id()
    return f"{stage}-{token}" if span_id is None else (f"{stage}-{span_id.replace('-', '')}", token)
