"""`rollart envs`: list the environments, play one by hand, or let a model play it with a flow task's prompt."""

from __future__ import annotations

import click

from rollart_dask.config import load_flow


@click.group()
def envs():
    """Environments: list them, play one by hand, or watch a model play one (its prompt as the model sees it)."""


@envs.command("list")
def envs_list():
    """Registered environments and rewards (built-in, registered, and entry points)."""
    from rollart_dask.registry import env_names, reward_names

    for kind, table in (("env", env_names()), ("reward", reward_names())):
        for name, target in sorted(table.items()):
            click.echo(f"{kind:7s} {name:20s} {target if isinstance(target, str) else repr(target)}")


@envs.command("try")
@click.argument("name")
@click.option("--seed", default=0, show_default=True, help="episode seed (held-out seeds start at 1000000)")
@click.option("--arg", "args", multiple=True, metavar="KEY=VALUE", help="env argument, e.g. --arg size=6")
@click.option("--max-turns", default=20, show_default=True)
@click.option(
    "--model",
    default=None,
    metavar="KIND|DIR",
    help="let a model play instead of you: tiny, smollm2 or a Hugging Face model "
    "directory; each turn shows the prompt rendered with its chat template and its answer (greedy)",
)
@click.option(
    "--flow",
    "flow_file",
    default=None,
    type=click.Path(dir_okay=False),
    help="with --model: take the task's env, env_args, prompt and max_tokens from this flow (NAME is then the task's name)",
)
@click.option("--max-tokens", default=None, type=int, help="with --model: tokens per answer (default: the flow task's, else 24)")
def envs_try(name, seed, args, max_turns, model, flow_file, max_tokens):
    """Play env NAME by hand: type actions, see observations, rewards and info. 'q' quits. With --model, a model plays."""
    import yaml

    from rollart_dask.registry import make_env

    kwargs = {}
    for a in args:
        if "=" not in a:
            raise click.BadParameter(f"{a!r}: expected KEY=VALUE", param_hint="--arg")
        k, v = a.split("=", 1)
        kwargs[k] = yaml.safe_load(v)
    task = _flow_task(flow_file, name) if flow_file else None
    if task is not None:
        name, kwargs, max_turns = task.env, {**task.env_args, **kwargs}, min(max_turns, task.max_turns)
    try:
        env = make_env(name, **kwargs)
    except (KeyError, TypeError, ValueError) as e:
        raise click.ClickException(str(e))
    obs, info = env.reset(seed=seed)
    choices = getattr(env, "action_choices", None)
    click.echo(f"{name} seed={seed}" + (f"  actions: {' '.join(choices)}" if choices else ""))
    player = _model_player(model, task, max_tokens) if model else None
    if player is None:
        click.echo(obs)
    total = 0.0
    for turn in range(1, max_turns + 1):
        action = player(obs) if player else click.prompt(f"turn {turn} action", default="q", show_default=False)
        if player is None and action.strip().lower() == "q":
            break
        obs, reward, terminated, truncated, info = env.step(action)
        total += reward
        click.echo(obs)
        click.echo(f"reward {reward}  total {total}  info {info}")
        if terminated or truncated:
            click.echo("terminated" if terminated else "truncated")
            break
    env.close()


def _flow_task(flow_file: str, name: str):
    cfg = load_flow(flow_file, [])
    for t in cfg.tasks:
        if t.name == name:
            return t
    raise click.ClickException(f"--flow {flow_file}: no task {name!r}; its tasks: {', '.join(t.name for t in cfg.tasks)}")


def _model_player(model: str, task, max_tokens: int | None):
    """A greedy player through the torch engine: each turn's prompt as the model sees it (chat template applied), then its answer."""
    from rollart_dask.config import ModelConfig, PromptConfig
    from rollart_dask.data.engine_torch import TorchEngine
    from rollart_dask.models.prepare import model_dir
    from rollart_dask.models.prompts import Conversation

    kind = model if model in ("tiny", "smollm2") else "path"
    try:
        engine = TorchEngine(str(model_dir(ModelConfig(kind=kind, path=model if kind == "path" else None))))
    except (OSError, ValueError) as e:
        raise click.ClickException(f"--model {model}: {e}")
    if not getattr(engine.tokenizer, "chat_template", None):
        raise click.ClickException(f"the model at {model} has no chat template (the tokenizer's 'chat_template' key)")
    prompt = task.prompt if task is not None else PromptConfig()
    chat = Conversation(prompt, task.max_turns if task is not None else 20)
    limit = max_tokens or (task.max_tokens if task is not None else 24)
    turn = iter(range(1_000_000))

    def play(observation: str) -> str:
        messages = chat.ask(observation)
        c = engine.generate(
            [{"id": f"try-{next(turn)}", "prompt": messages, "max_tokens": limit, "temperature": 0.0, "stop": list(prompt.stop)}]
        )[0]
        click.echo(click.style("prompt (as the model sees it):", bold=True))
        click.echo(engine.tokenizer.decode(c.prompt_ids))
        click.echo(click.style(f"answer ({len(c.token_ids)} tokens, {c.finish_reason}):", bold=True) + f" {c.text!r}")
        chat.answered(c.text)
        return c.text

    return play
