"""EMULATED faults of the local endpoint (the chaos suite; off unless asked): a synchronous invocation is answered
429, 500 or late at set rates, drawn from a seeded generator in the order invocations arrive."""

from __future__ import annotations

import asyncio
import random

from rollart_dask.serve.lambda_local.api import LambdaError


class EndpointFaults:
    def __init__(self, spec: dict | None = None):
        self.spec = {"throttle": 0.0, "error": 0.0, "slow": 0.0, "slow_s": 1.0, "seed": 0, **(spec or {})}
        self.rng = random.Random(self.spec["seed"])
        self.injected = {"throttle": 0, "error": 0, "slow": 0}

    @property
    def active(self) -> bool:
        return any(self.spec[k] for k in self.injected)

    async def before_invoke(self) -> None:
        """Throttle, fail or delay this invocation (or let it be)."""
        f, u = self.spec, self.rng.random()
        if u < f["throttle"]:
            self.injected["throttle"] += 1
            raise LambdaError(
                429, "TooManyRequestsException", "Rate Exceeded. (EMULATED fault)", Reason="ConcurrentInvocationLimitExceeded"
            )
        if u < f["throttle"] + f["error"]:
            self.injected["error"] += 1
            raise LambdaError(500, "ServiceException", "EMULATED fault: the service failed this invocation")
        if u < f["throttle"] + f["error"] + f["slow"]:
            self.injected["slow"] += 1
            await asyncio.sleep(f["slow_s"])
