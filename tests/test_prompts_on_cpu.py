"""Prompting per task (tasks[].prompt): the messages of each turn, the model's own chat template with its generation
prompt, stop strings in the engine, and what a flow is refused for at load (no chat template, no room in the context,
a placeholder the env does not provide). Generate timeouts that follow the engine's measured speed (control/timeouts.py)."""

import shutil

import pytest
import yaml

from rollart_dask.config import FlowError, PromptConfig, load_flow
from rollart_dask.control.timeouts import FIRST_S, FLOOR_S, SLACK, GenerateTimeouts
from rollart_dask.models.prompts import Conversation, check_prompts, cut_at_stop


def flow(**prompt):
    d = yaml.safe_load(open("flows/llm_math.yaml"))
    d["model"] = {"kind": "tiny"}
    d["tasks"][0]["prompt"] = prompt
    return d


def test_a_conversation_renders_system_first_and_next_and_keeps_history_only_when_asked():
    p = PromptConfig(
        system_prompt="Be brief.",
        first="{observation}\n{format_hint} ({turn}/{max_turns})",
        next="now: {observation}",
        format_hint="One word.",
    )
    chat = Conversation(p, max_turns=3)
    assert chat.ask("A") == (("system", "Be brief."), ("user", "A\nOne word. (0/3)"))
    chat.answered("left")
    assert chat.ask("B") == (("system", "Be brief."), ("user", "now: B"))  # history off: the current observation only
    chat = Conversation(p.model_copy(update={"history": True}), max_turns=3)
    chat.ask("A")
    chat.answered("left")
    assert chat.ask("B") == (("system", "Be brief."), ("user", "A\nOne word. (0/3)"), ("assistant", "left"), ("user", "now: B"))
    assert Conversation(PromptConfig(), 1).ask("obs") == "obs"  # the default: the observation as the one user message


def test_bad_prompt_values_are_refused_at_load_naming_what_is_wrong():
    with pytest.raises(FlowError, match=r"placeholder \{question\} is not provided by the env; allowed: \{observation\}, \{format_hint\}"):
        load_flow(data=flow(first="{question}"))
    with pytest.raises(FlowError, match=r"prompt.sistem: unknown key \(allowed: first, format_hint, history, next, stop, system_prompt\)"):
        load_flow(data=flow(sistem="x"))
    with pytest.raises(FlowError, match="prompt.system_prompt: placeholder {observation}"):
        load_flow(data=flow(system_prompt="{observation}"))
    with pytest.raises(FlowError, match="empty stop string"):
        load_flow(data=flow(stop=[""]))
    assert load_flow(data=flow(first="{{literal}} {observation}")).tasks[0].prompt.first == "{{literal}} {observation}"


def test_stop_strings_cut_the_text_at_the_first_one():
    assert cut_at_stop("left. Then up\n", [".", "\n"]) == ("left", True)
    assert cut_at_stop("left", ["\n"]) == ("left", False)
    assert cut_at_stop("left", []) == ("left", False)


@pytest.fixture(scope="module")
def tiny_dir():
    from rollart_dask.models.prepare import model_dir
    from rollart_dask.config import ModelConfig

    return model_dir(ModelConfig(kind="tiny"))


def test_a_flow_is_refused_when_its_first_prompt_and_max_tokens_pass_the_context(tiny_dir):
    cfg = load_flow(data=flow(first="{observation} " + "pad " * 100))
    lengths = check_prompts(cfg, tiny_dir)
    n = lengths["math"]  # a character model: one token per character, and the template's newline
    assert n > 400
    cfg.tasks[0].max_tokens = 600
    with pytest.raises(FlowError, match=rf"first prompt is {n} tokens and max_tokens is 600: {n + 600} exceeds the model's context of 512"):
        check_prompts(cfg, tiny_dir)


def test_a_model_without_a_chat_template_is_refused_naming_the_key(tiny_dir, tmp_path):
    import json

    bare = tmp_path / "bare"
    shutil.copytree(tiny_dir, bare)
    (bare / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((bare / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(FlowError, match="has no chat template .*'chat_template' key"):
        check_prompts(load_flow(data=flow()), bare)


@pytest.fixture(scope="module")
def smollm2_engine():
    from rollart_dask.data.engine_torch import TorchEngine
    from rollart_dask.models.smollm2 import build_smollm2

    return TorchEngine(str(build_smollm2()))


def test_the_engine_applies_the_models_chat_template_with_its_generation_prompt(smollm2_engine):
    tok = smollm2_engine.tokenizer
    messages = (("system", "Be brief."), ("user", "Calculate 74 - 2."))
    c = smollm2_engine.generate([{"id": "a", "prompt": messages, "max_tokens": 4, "temperature": 0.0}])[0]
    text = tok.decode(c.prompt_ids)
    assert text.endswith("<|im_start|>assistant\n")  # the generation prompt: the model answers as the assistant
    assert "<|im_start|>system\nBe brief.<|im_end|>" in text and "<|im_start|>user\nCalculate 74 - 2.<|im_end|>" in text
    assert c.prompt_ids == tok.apply_chat_template(
        [{"role": r, "content": m} for r, m in messages], add_generation_prompt=True, tokenize=True, return_dict=False
    )


def test_a_stop_string_ends_the_turn_and_the_env_gets_the_text_before_it(smollm2_engine):
    req = {"prompt": "Calculate 74 - 2.", "max_tokens": 16, "temperature": 0.0}
    free = smollm2_engine.generate([{**req, "id": "free"}])[0]
    assert free.text.startswith("To calculate")  # (SmolLM2's greedy answer; the stop below is one of its words)
    stopped = smollm2_engine.generate([{**req, "id": "stop", "stop": ["calculate"]}])[0]
    assert stopped.finish_reason == "stop" and stopped.text == "To "
    assert len(stopped.token_ids) < len(free.token_ids) and stopped.token_ids == free.token_ids[: len(stopped.token_ids)]
    assert "calculate" in smollm2_engine.tokenizer.decode(stopped.token_ids)  # the trainer trains every token generated


def test_generate_timeouts_follow_the_engines_measured_speed_and_the_work_queued_on_it():
    now = [0.0]
    t = GenerateTimeouts("auto", clock=lambda: now[0])
    assert t.start("e", 24) == FIRST_S  # nothing measured yet
    now[0] = 2.0
    t.done("e", 24, 20)  # 20 tokens in 2 busy seconds: 10 tokens/s
    assert t.rate("e") == pytest.approx(10.0)
    assert t.budget("e", 24) == FLOOR_S  # 4 × 24 / 10 = 9.6 s: the floor
    for _ in range(100):  # 100 calls of 24 tokens queued on it
        t.start("e", 24)
    assert t.budget("e", 24) == pytest.approx(SLACK * 101 * 24 / 10.0)
    now[0] = 12.0
    for _ in range(100):
        t.done("e", 24, 0)  # all failed: 10 more busy seconds and no token, the measured speed halves
    assert t.rate("e") == pytest.approx(20 / 12.0)
    assert GenerateTimeouts(30).start("e", 24) == 30.0  # a fixed timeout stays fixed


def test_a_generate_call_times_out_only_when_its_engine_answers_nothing_for_its_budget():
    import asyncio

    async def scenario():
        t = GenerateTimeouts("auto", floor_s=0.3, first_s=0.3)
        loop = asyncio.get_running_loop()
        # a busy engine: the call waits 1 s, but the engine answers another call every 0.2 s meanwhile
        slow = loop.create_future()
        loop.call_later(1.0, slow.set_result, "answer")
        t.start("busy", 8)
        started = t.clock()

        async def others():
            for _ in range(6):
                await asyncio.sleep(0.2)
                t.start("busy", 8)
                t.done("busy", 8, 8)

        helper = asyncio.ensure_future(others())
        assert await t.wait(slow, "busy", started) == "answer"
        await helper
        # a stuck engine: nothing answered, the budget runs out and the call is cancelled
        stuck = loop.create_future()
        t.start("stuck", 8)
        t0 = t.clock()
        with pytest.raises(TimeoutError, match="the engine answered no call within its budget"):
            await t.wait(stuck, "stuck", t0)
        assert stuck.cancelled() and 0.25 < t.clock() - t0 < 1.0
        fixed = GenerateTimeouts(5)
        done = loop.create_future()
        done.set_result("x")
        assert await fixed.wait(done, "e", fixed.clock()) == "x"

    asyncio.run(scenario())
