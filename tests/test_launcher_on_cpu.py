"""The launcher's bookkeeping when the buffer drops a group, without a cluster: rollout itself is a stand-in
that never finishes (what happens on the engines and envs is tested on the cluster), so only the launcher's
own reaction is seen. With ``max_relaunch: 0`` a failed member drops its group and cancels the rest of it;
the launcher must then admit a group in its place, or an eager run waits for a batch that never comes."""

import asyncio
from collections import Counter

from conftest import flow_dict
from rollart_dask.config import load_flow
from rollart_dask.control.buffer import SampleBuffer
from rollart_dask.control.launcher import Launcher


class Rollout:
    """Stands in for the EnvManager and LLMProxy: trajectories run until cancelled."""

    version = 0

    def __init__(self):
        self.started: list[str] = []
        self.aborted: list[str] = []

    async def run(self, traj, task, barrier=None, eval_temperature=None, on_start=None):
        self.started.append(traj.id)
        await asyncio.Event().wait()

    async def cancel(self, traj_ids):
        self.aborted += traj_ids


def test_a_group_dropped_before_its_members_started_makes_room_for_another(run_async):
    cfg = load_flow(
        data=flow_dict(
            **{
                "rollout.admission": "eager",
                "rollout.alpha": 1,
                "rollout.batch_groups": 1,
                "rollout.group_size": 2,
                "rollout.max_relaunch": 0,
            }
        )
    )
    r = cfg.rollout

    async def go():
        buffer = SampleBuffer(r.group_size, r.redundancy, r.alpha, r.max_relaunch)
        rollout = Rollout()
        launcher = Launcher(cfg, buffer, rollout, rollout, Counter())
        loop = asyncio.ensure_future(launcher.loop())
        try:
            await asyncio.sleep(0)  # the loop admitted (α + 1) × batch_groups groups; their members have not started
            assert buffer.opened == 2 and len(launcher.members) == 4 and rollout.started == []
            first, sibling = sorted(t for t in launcher.members if t.startswith("g0-"))
            launcher.carry_out(buffer.failed(first))  # no relaunch allowed: g0 is dropped, its sibling cancelled
            for _ in range(20):
                await asyncio.sleep(0)
            return buffer.opened, buffer.dropped, sorted(launcher.members), sibling, rollout
        finally:
            await launcher.stop()
            loop.cancel()

    opened, dropped, members, sibling, rollout = run_async(go(), timeout=60)
    assert dropped == 1
    assert sibling in rollout.aborted and sibling not in rollout.started
    assert sibling not in members, "a member cancelled before its first step was never cleaned up"
    assert opened == 3, "the dropped group's place was not given to a new one: an eager run would wait forever"
