"""The written contracts (data/contracts.py) against every registered backend, the registries that
choose backends, advantages and losses by name, and the flow keys that choose them."""

import ast
import inspect
from pathlib import Path
from typing import get_args

import pytest
import torch

import rollart_dask
from conftest import flow_dict
from rollart_dask.algo.advantages import ADVANTAGES, grpo_advantages
from rollart_dask.algo.losses import LOSSES, ppo_clip_loss
from rollart_dask.algo.samples import build_samples
from rollart_dask.capabilities import pd_unsupported_reason
from rollart_dask.config import EmulationConfig, EngineConfig, TrainerConfig, load_flow
from rollart_dask.data import contracts, plugins
from rollart_dask.data.backends import ENGINES, TRAINERS
from rollart_dask.data.reward_runner import RewardRunner
from rollart_dask.registry import Registry, UnknownName
from rollart_dask.types import Trajectory, Turn

PACKAGE = Path(rollart_dask.__file__).parent


def backend(registry: Registry, name: str) -> type:
    try:
        return registry.get(name)
    except ImportError as e:  # a backend's module that cannot even be imported on this platform
        pytest.skip(f"{registry.kind} {name}: its module does not import here ({e})")


# -- conformance: names and signatures of every registered backend ----------------------------------------
@pytest.mark.parametrize("name", ENGINES.names())
def test_engine_backends_follow_the_engine_contract(name):
    cls = backend(ENGINES, name)
    assert contracts.conformance(cls, contracts.Engine) == []
    assert contracts.conformance(cls, contracts.EngineBackend) == []
    # the optional PD capability is there exactly where capabilities.py says rollout.pd may use it
    pd_ok = contracts.conformance(cls, contracts.DisaggregatingEngine) == []
    assert pd_ok == (pd_unsupported_reason(name) is None), (name, contracts.conformance(cls, contracts.DisaggregatingEngine))


@pytest.mark.parametrize("name", TRAINERS.names())
def test_trainer_backends_follow_the_trainer_contract(name):
    cls = backend(TRAINERS, name)
    assert contracts.conformance(cls, contracts.Trainer) == []
    assert contracts.conformance(cls, contracts.TrainerBackend) == []
    swallowed = [p.name for p in inspect.signature(cls).parameters.values() if p.kind is p.VAR_KEYWORD]
    assert swallowed == [], f"{cls.__name__}(**{swallowed[0]}): a misspelled setting would vanish instead of failing"


def test_reward_runner_follows_its_contract():
    assert contracts.conformance(RewardRunner, contracts.RewardRunner) == []


def test_registries_hold_the_backends_the_flow_schema_allows():
    assert set(ENGINES.names()) == set(get_args(EngineConfig.model_fields["backend"].annotation)) - {"auto"}
    assert set(TRAINERS.names()) == set(get_args(TrainerConfig.model_fields["backend"].annotation))


def test_conformance_reports_what_breaks_the_contract():
    """The checker itself: each way of breaking a contract is reported, naming the member."""

    class Broken:
        version: int

        def train_step(self, batch):  # renamed parameter
            ...

        def state_dict(self, full):  # a parameter no caller passes
            ...

        def save_checkpoint(self, path, **_ignored):  # swallows anything
            ...

        @staticmethod
        def restore(path):  # not a method of the instance: its first parameter would be taken for self
            ...

        def warm_start(self, demos, steps, batch_size, lr, seed, shares=None):  # seed lost its default
            ...

    problems = "\n".join(contracts.conformance(Broken, contracts.Trainer))
    for expected in (
        "train_step: parameter 1 must be 'samples'",
        "state_dict: extra parameter 'full'",
        "save_checkpoint: takes **_ignored",
        "restore: parameter 1 must be 'path'",
        "warm_start: 'seed' needs a default",
    ):
        assert expected in problems
    assert "version" not in problems

    class NoVersion:
        def train_step(self, samples): ...

    assert any("NoVersion.version: missing" in p for p in contracts.conformance(NoVersion, contracts.Trainer))
    assert contracts.conformance(type("Plain", (), {"from_config": lambda self, cfg: None}), contracts.TrainerBackend) == [
        "Plain.from_config: must be a classmethod"
    ]


# -- instances built from the flow's sections ------------------------------------------------------------
def test_cheap_backends_built_from_config_are_instances_of_the_contracts(model_dir):
    emulation = EmulationConfig(time_scale=0)
    eng = ENGINES.get("emulated").from_config(EngineConfig(), model_dir=str(model_dir), pool="H20", emulation=emulation)
    assert isinstance(eng, contracts.StreamingEngine) and isinstance(eng, contracts.DisaggregatingEngine)
    assert eng.stats["instances"] == emulation.pools["H20"].gpus // emulation.pools["H20"].tp and eng.stats["gpu"] == "H20"
    trainer = TRAINERS.get("emulated").from_config(TrainerConfig(backend="emulated"), model_dir=str(model_dir), emulation=emulation)
    assert isinstance(trainer, contracts.Trainer) and trainer.warm_start([], 0, 64, 1e-3)["version"] == 1
    threads = torch.get_num_threads()
    try:
        torch_engine = ENGINES.get("torch").from_config(EngineConfig(max_batch=3), model_dir=str(model_dir), seed=1)
        torch_trainer = TRAINERS.get("torch").from_config(TrainerConfig(lr=0.5, clip=0.3), model_dir=str(model_dir), temperature=0.7)
    finally:
        torch.set_num_threads(threads)
    assert isinstance(torch_engine, contracts.Engine) and torch_engine.max_batch == 3
    assert isinstance(torch_trainer, contracts.Trainer)
    assert (torch_trainer.lr, torch_trainer.clip, torch_trainer.temperature) == (0.5, 0.3, 0.7)


def test_emulated_engine_plugin_builds_the_pool_of_its_worker(model_dir):
    cfg = load_flow(
        data=flow_dict(
            **{
                "engine.backend": "emulated",
                "trainer.backend": "emulated",
                "emulation": {"time_scale": 0, "pools": {"H800": {"gpu": "H800", "gpus": 8, "tp": 2}, "H20": {"gpu": "H20", "gpus": 0}}},
            }
        )
    )
    plugin = plugins.engine_plugin(cfg, ["H20", "H800"], str(model_dir), "emulated")
    plugin.pool = "H800"  # what setup() finds in the worker's resources
    eng = plugin.build()
    assert eng.stats["instances"] == 4 and eng.stats["gpu"] == "H800"
    plugin.pool = "H20"
    with pytest.raises(RuntimeError, match="no GPUs for pool H20"):
        plugin.build()
    assert isinstance(plugins.trainer_plugin(cfg, str(model_dir)).build(), contracts.Trainer)


# -- registries -----------------------------------------------------------------------------------------
def test_registry_rejects_a_duplicate_name_naming_it():
    with pytest.raises(ValueError, match=r"engine backend 'torch' is already registered \(to rollart_dask.data.engine_torch:TorchEngine\)"):
        ENGINES.register("torch", "somewhere.else:Engine")
    assert ENGINES.get("torch").__name__ == "TorchEngine"  # the first registration stands
    losses = Registry("loss", {"ppo_clip": ppo_clip_loss})
    with pytest.raises(ValueError, match="loss 'ppo_clip' is already registered"):
        losses.register("ppo_clip")(lambda **kw: None)


def test_registry_unknown_name_lists_the_allowed_ones():
    for registry, allowed in (
        (ENGINES, "emulated, null, torch, vllm"),
        (TRAINERS, "emulated, megatron, torch"),
        (LOSSES, "ppo_clip"),
        (ADVANTAGES, "grpo"),
    ):
        with pytest.raises(UnknownName) as err:
            registry.get("nope")
        assert str(err.value) == f"unknown {registry.kind} 'nope'; allowed: {allowed}"
    with pytest.raises(UnknownName, match="allowed: emulated, null, torch, vllm"):
        plugins.EnginePlugin(["H800"], backend="tensorrt", engine=EngineConfig(), model_dir="m")  # in the client, before any worker


def test_registry_imports_a_lazy_entry_only_when_chosen():
    r = Registry("thing", {"later": "no_such_module_here:Thing"})
    assert "later" in r and r.check("later") == "later"  # registering and checking import nothing
    with pytest.raises(ModuleNotFoundError, match="no_such_module_here"):
        r.get("later")
    with pytest.raises(ValueError, match="'module:attr'"):
        r.register("bad", "not_a_target")


def _imports(path: Path) -> list[str]:
    """Every module a file imports, at any level (relative imports resolved)."""
    package = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1])
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(p for p in (base, node.module) if p)
            out += [module] + [f"{module}.{a.name}" for a in node.names]
    return out


def test_data_plane_never_imports_the_tools_and_registries_import_no_runtime():
    files = sorted((PACKAGE / "data").rglob("*.py"))
    assert files and _imports(PACKAGE / "data" / "backends.py")  # the walk sees the files and their imports
    for f in files:
        assert not [m for m in _imports(f) if m.startswith(("rollart_dask.tools", "rollart_dask.emulation", "rollart_dask.serve"))], f
    for f in [PACKAGE / "registry.py", *sorted((PACKAGE / "algo").glob("*.py"))]:
        runtime = [
            m
            for m in _imports(f)
            if m.startswith("rollart_dask.") and not m.startswith(("rollart_dask.registry", "rollart_dask.algo", "rollart_dask.types"))
        ]
        assert runtime == [], f


# -- algorithm keys of the flow -------------------------------------------------------------------------
def test_flow_algorithm_keys_name_exactly_the_registered_ones():
    assert get_args(TrainerConfig.model_fields["advantage"].annotation) == tuple(ADVANTAGES.names())
    assert get_args(TrainerConfig.model_fields["loss"].annotation) == tuple(LOSSES.names())
    cfg = load_flow(data=flow_dict())
    assert (cfg.trainer.advantage, cfg.trainer.loss) == ("grpo", "ppo_clip")
    with pytest.raises(ValueError, match=r"trainer.loss: bad value 'dpo'.*'ppo_clip'"):
        load_flow(data=flow_dict(), overrides=["trainer.loss=dpo"])
    with pytest.raises(ValueError, match=r"trainer.advantage: bad value 'rloo'.*'grpo'"):
        load_flow(data=flow_dict(), overrides=["trainer.advantage=rloo"])


def test_configured_advantage_builds_the_samples():
    cfg = load_flow(data=flow_dict())
    turn = Turn("obs", [1, 2], [3], [-0.5], None, 0)
    group = type("G", (), {"task": "t", "kept": [Trajectory(f"x{i}", "g", "t", 0, [turn], 0, float(i % 2)) for i in range(4)]})
    samples, _ = build_samples([group], ADVANTAGES.get(cfg.trainer.advantage))
    assert [s["advantage"] for s in samples] == grpo_advantages([0.0, 1.0, 0.0, 1.0])


def test_configured_loss_reaches_the_trainer(model_dir, monkeypatch):
    """trainer.loss → trainer_plugin → TRAINERS → TorchTrainer → LOSSES: the loss the flow names is the one each step calls."""
    calls = []

    def spy(**kw):
        calls.append(kw)
        return ppo_clip_loss(**kw)

    assert list(inspect.signature(ppo_clip_loss).parameters) == [
        "logp",
        "old_logp",
        "advantages",
        "mask",
        "clip",
        "entropy",
        "entropy_coef",
        "is_weights",
        "token_weights",
    ]
    monkeypatch.setitem(LOSSES._entries, "ppo_clip", spy)
    cfg = load_flow(data=flow_dict(**{"trainer.clip": 0.15, "trainer.entropy_coef": 0.01, "trainer.correction": "tis"}))
    threads = torch.get_num_threads()
    try:
        trainer = plugins.trainer_plugin(cfg, str(model_dir)).build()
    finally:
        torch.set_num_threads(threads)
    metrics = trainer.train_step([{"prompt_ids": [1, 2, 3], "response_ids": [4, 5], "logprobs": [-1.0, -1.0], "advantage": 1.0}])
    assert metrics["version"] == 1 and len(calls) == 1
    assert (calls[0]["clip"], calls[0]["entropy_coef"]) == (0.15, 0.01)
    assert calls[0]["is_weights"] is not None and "is_truncated" in metrics  # trainer.correction reached it too
