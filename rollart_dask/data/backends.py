"""The engine and trainer backends a flow chooses (``engine.backend``, ``trainer.backend``).

Entries are lazy ``"module:attr"`` strings: vllm, megatron-core and the emulation tool are imported
only in the workers that build them. Each class satisfies data/contracts.py (``Engine`` +
``EngineBackend``, ``Trainer`` + ``TrainerBackend``) and is built with ``from_config``. The emulated
backends belong to a tool above the runtime (rollart_dask/emulation): the data plane names them
here as strings only and never imports that package.
"""

from __future__ import annotations

import os

from rollart_dask.registry import Registry

ENGINES = Registry(
    "engine backend",
    {
        "torch": "rollart_dask.data.engine_torch:TorchEngine",
        "vllm": "rollart_dask.data.engine_vllm:VLLMEngine",
        "emulated": "rollart_dask.emulation.engine:EmulatedInstances",  # EMULATED hardware timing
        "null": "rollart_dask.emulation.null:NullEngine",  # NULL: answers at once (control-plane benchmark)
    },
)

TRAINERS = Registry(
    "trainer backend",
    {
        "torch": "rollart_dask.data.trainer_torch:TorchTrainer",
        "megatron": "rollart_dask.data.trainer_megatron:MegatronTrainer",
        "emulated": "rollart_dask.emulation.trainer:EmulatedTrainer",  # EMULATED step time
    },
)


def set_torch_threads() -> None:
    """Torch backends call it when built: the worker's torch_threads (OMP_NUM_THREADS), not every core."""
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
