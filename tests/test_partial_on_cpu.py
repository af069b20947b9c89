"""rollout.partial=continue without a cluster: a turn interrupted by Suspend goes on from its prefix. The engines
continue exactly where they stopped (same greedy tokens as never stopping, a choice half decoded stays a choice), the
emulated engine returns what it generated before an abort, and the proxy joins the pieces with a version per token."""

import threading

import torch

from rollart_dask.config import EmulationConfig, EngineConfig
from rollart_dask.control.proxy import Prefix
from rollart_dask.data.backends import ENGINES
from rollart_dask.types import Completion
from tests.conftest import wait_for


def torch_engine(model_dir):
    threads = torch.get_num_threads()
    try:
        return ENGINES.get("torch").from_config(EngineConfig(), model_dir=str(model_dir), seed=0)
    finally:
        torch.set_num_threads(threads)


def test_torch_engine_continues_from_a_prefix_as_if_never_stopped(model_dir):
    engine = torch_engine(model_dir)
    ask = {"id": "a#0", "prompt": "the map is", "choices": None, "max_tokens": 12, "temperature": 0.0}
    (whole,) = engine.generate([ask])
    assert len(whole.token_ids) == 12, whole.finish_reason  # greedy, no early stop at this length
    (rest,) = engine.generate([dict(ask, id="a#1", prefix_ids=whole.token_ids[:5], max_tokens=7)])
    assert rest.token_ids == whole.token_ids[5:]
    assert rest.prompt_ids == whole.prompt_ids + whole.token_ids[:5]  # the prefix was prefilled after the prompt
    assert rest.text == whole.text  # the whole response's text


def test_a_choice_continued_half_way_is_still_one_of_the_choices(model_dir):
    engine = torch_engine(model_dir)
    choices = ["move left now", "move right now"]
    ask = {"id": "c#0", "prompt": "go", "choices": choices, "max_tokens": 16, "temperature": 1.0}
    (whole,) = engine.generate([ask])
    assert whole.text in choices and len(whole.token_ids) > 2
    (rest,) = engine.generate([dict(ask, id="c#1", prefix_ids=whole.token_ids[:2], max_tokens=14)])
    assert rest.text in choices and rest.text.startswith(engine.tokenizer.decode(whole.token_ids[:2], skip_special_tokens=True))


def test_emulated_engine_returns_what_it_generated_before_an_abort_and_continues_from_it():
    engine = ENGINES.get("emulated").from_config(
        EngineConfig(),
        model_dir="",
        pool="H20",
        emulation=EmulationConfig(time_scale=0.05, pools={"H20": {"gpu": "H20", "gpus": 1, "tp": 1}}),
    )
    emulate = {"prompt_tokens": 64, "output_tokens": 20_000}
    done: list = []
    runner = threading.Thread(
        target=lambda: done.extend(
            engine.generate([{"id": "m#0", "prompt": "", "max_tokens": 30_000, "temperature": 1.0, "emulate": emulate}])
        ),
        daemon=True,
    )
    runner.start()
    (instance,) = engine.engines

    def decoding():
        seq = instance.batch.running.get("m#0")
        return seq is not None and instance.batch.step_no > seq.admit_step + 10

    wait_for(decoding, timeout=30, what="m#0 decoding")
    engine.abort(["m#0"])
    runner.join(30)
    (cut,) = done
    k = len(cut.token_ids)
    assert cut.finish_reason == "abort" and 0 < k < 20_000 and len(cut.logprobs) == k
    (rest,) = engine.generate(
        [{"id": "m#1", "prompt": "", "max_tokens": 30_000 - k, "temperature": 1.0, "emulate": emulate, "prefix_ids": list(cut.token_ids)}]
    )
    assert len(rest.token_ids) == 20_000 - k and len(rest.prompt_ids) == 64 + k  # the rest, after re-prefilling the prefix


def test_the_proxy_joins_a_turn_with_the_version_of_every_token():
    p = Prefix()
    p.add(Completion("t#0", [1, 2], [7, 8, 9], [-0.1, -0.2, -0.3], None, "", "abort", 0))
    p.add(Completion("t#1", [1, 2, 7, 8, 9], [], [], None, "", "abort", 1))  # aborted again before its first token
    turn = p.join(Completion("t#2", [1, 2, 7, 8, 9], [10, 11], [-0.4, -0.5], None, "abcde", "stop", 2))
    assert turn.prompt_ids == [1, 2] and turn.token_ids == [7, 8, 9, 10, 11] and turn.text == "abcde"
    assert turn.logprobs == [-0.1, -0.2, -0.3, -0.4, -0.5] and turn.token_versions == [0, 0, 0, 2, 2]
    fresh = Completion("u#0", [1], [5], [-1.0], None, "x", "stop", 3)
    assert Prefix().join(fresh) is fresh and fresh.token_versions is None  # never interrupted: one version
