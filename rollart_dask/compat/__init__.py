"""Every use of distributed's and its dashboard's private API, each behind a named function.

distributed gives no public way to do these few things (docs/reference/compat.md lists each, why, and its test).
A release that renames one of them must fail loudly, naming it, not leave a hook that silently does nothing:
``check()`` looks every one up; the run calls it at start and tests/test_compat.py removes each in turn.
setup.cfg pins distributed to the releases the tests passed on; ``make test-upgrade`` runs these tests on the newest.
The dashboard's hooks (compat/dashboard.py) import Bokeh, so they are imported apart, on the scheduler.
"""

from rollart_dask.compat.hooks import HOOKS, DistributedIncompatible, check
from rollart_dask.compat.private import (
    NO_REPLY,
    CommClosedError,
    SchedulerSubprocess,
    batched_send,
    charge_span,
    correct_state,
    cut_scheduler_connection,
    dial_scheduler,
    file_in_task_stream,
    nanny_of,
    open_comm,
    plugin_names,
    scheduler_connection,
    set_worker_handler,
    stand_down,
    task_stream,
    worker_handler,
    wrap_reconnect,
)

__all__ = [
    "HOOKS",
    "NO_REPLY",
    "CommClosedError",
    "DistributedIncompatible",
    "SchedulerSubprocess",
    "batched_send",
    "charge_span",
    "check",
    "correct_state",
    "cut_scheduler_connection",
    "dial_scheduler",
    "file_in_task_stream",
    "nanny_of",
    "open_comm",
    "plugin_names",
    "scheduler_connection",
    "set_worker_handler",
    "stand_down",
    "task_stream",
    "worker_handler",
    "wrap_reconnect",
]
