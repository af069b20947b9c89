"""What a chat model sees on each turn: a task's ``prompt`` section (config.PromptConfig) applied to the env's
observations, as chat messages; the engine then applies the model's own chat template, with the assistant's
generation prompt, on every turn (data/encoding.py ``chat_prompt_ids``).

Messages are a tuple of (role, content) pairs: hashable, so an engine caches each distinct prompt's token ids,
and plain data, so a trajectory's record keeps exactly the messages of each turn beside their token ids.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rollart_dask.config import PromptConfig

Messages = tuple[tuple[str, str], ...]


def user_message(prompt: PromptConfig, observation: str, turn: int, max_turns: int) -> str:
    """The user message of ``turn`` (0: the ``first`` template, later ones ``next``)."""
    template = prompt.first if turn == 0 else prompt.next
    return template.format(observation=observation, format_hint=prompt.format_hint, turn=turn, max_turns=max_turns)


class Conversation:
    """One trajectory's messages so far; ``ask`` gives the messages of the next turn, ``answered`` records the reply."""

    def __init__(self, prompt: PromptConfig, max_turns: int):
        self.prompt, self.max_turns = prompt, max_turns
        self.past: list[tuple[str, str]] = []  # earlier (user, assistant) messages, kept when prompt.history
        self.turn = 0

    def ask(self, observation: str) -> Messages | str:
        """The next turn's messages; a lone user message as its text (what engines without a chat model, emulated ones,
        read as the prompt; a chat model templates either the same way)."""
        system = (("system", self.prompt.system_prompt),) if self.prompt.system_prompt else ()
        user = ("user", user_message(self.prompt, observation, self.turn, self.max_turns))
        self._asked = user
        messages = (*system, *self.past, user)
        return user[1] if len(messages) == 1 else messages

    def answered(self, text: str) -> None:
        if self.prompt.history:
            self.past += [self._asked, ("assistant", text)]
        self.turn += 1


def as_chat(messages: Messages | list[dict] | str) -> list[dict]:
    """Messages in the form chat templates take: a bare string is one user message."""
    if isinstance(messages, str):
        return [{"role": "user", "content": messages}]
    return [m if isinstance(m, dict) else {"role": m[0], "content": m[1]} for m in messages]


def cut_at_stop(text: str, stop: list[str] | tuple[str, ...] | None) -> tuple[str, bool]:
    """The text before the first stop string, and whether one was found."""
    if not stop:
        return text, False
    at = min((i for s in stop if (i := text.find(s)) >= 0), default=-1)
    return (text[:at], True) if at >= 0 else (text, False)


def first_prompt_ids(tokenizer, prompt: PromptConfig, observation: str, max_turns: int) -> list[int]:
    """The token ids of a trajectory's first turn, as the engines template it."""
    messages = Conversation(prompt, max_turns).ask(observation)
    return list(tokenizer.apply_chat_template(as_chat(messages), tokenize=True, add_generation_prompt=True, return_dict=False))


def check_prompts(cfg, model_dir) -> dict[str, int]:
    """Refuse at load what every turn would fail on: a model without a chat template, and a first prompt that leaves no
    room for ``max_tokens`` in the model's context. Returns each task's first-prompt length (an env that cannot be built
    here is left to the run, which reports it)."""
    import json
    from pathlib import Path

    from rollart_dask.config import FlowError
    from rollart_dask.models.tiny import load_tokenizer
    from rollart_dask.registry import make_env

    tokenizer = load_tokenizer(model_dir)
    if not getattr(tokenizer, "chat_template", None):
        raise FlowError(
            f"the model at {model_dir} has no chat template (the tokenizer's 'chat_template' key, in tokenizer_config.json or "
            f"chat_template.jinja): every turn is rendered with the model's own template; add one to the model directory"
        )
    config = json.loads((Path(model_dir) / "config.json").read_text())
    context = config.get("max_position_embeddings")
    lengths = {}
    for t in cfg.tasks:
        try:
            env = make_env(t.env, **t.env_args)
            try:
                observation, _ = env.reset(seed=0)
            finally:
                getattr(env, "close", lambda: None)()
        except Exception:  # (the run names an env that cannot be built or reset)
            continue
        if not isinstance(observation, str):
            continue
        n = lengths[t.name] = len(first_prompt_ids(tokenizer, t.prompt, observation, t.max_turns))
        if context and n + t.max_tokens > context:
            raise FlowError(
                f"tasks.{t.name}: the first prompt is {n} tokens and max_tokens is {t.max_tokens}: {n + t.max_tokens} exceeds the "
                f"model's context of {context} tokens (max_position_embeddings in {Path(model_dir) / 'config.json'}); "
                f"shorten tasks.{t.name}.prompt or lower tasks.{t.name}.max_tokens"
            )
    return lengths
