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
