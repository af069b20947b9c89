"""Token-level encoding shared by the engines and the trainer: the chat-templated prompt, the
trie of allowed completions for constrained decoding, and demonstrations encoded exactly as
the engine would have produced them (same prompt ids, same response ids, same allowed sets),
so imitation and RL train one and the same policy distribution."""

from __future__ import annotations

from rollart_dask.models.prompts import as_chat


class ChoiceTrie:
    """Token-id prefix trie over a request's allowed completions."""

    def __init__(self, choices_ids: list[list[int]], eos: int):
        self.root: dict = {}
        for ids in choices_ids:
            node = self.root
            for t in ids:
                node = node.setdefault(t, {})
            node[None] = {}  # end marker
        self._stop_prefixes(self.root, eos)

    @classmethod
    def _stop_prefixes(cls, node: dict, eos: int) -> None:
        """A choice that is a prefix of another ('1' and '12') ends by an explicit EOS."""
        for tok, child in list(node.items()):
            if tok is not None:
                cls._stop_prefixes(child, eos)
        if None in node and len(node) > 1:
            del node[None]
            node[eos] = {None: {}}

    @staticmethod
    def allowed(node: dict) -> list[int]:
        return [t for t in node if t is not None]

    @staticmethod
    def finished(node: dict) -> bool:
        return None in node and not ChoiceTrie.allowed(node)

    def walk(self, token_ids: list[int], eos: int) -> tuple[list[int], list[list[int]]]:
        """The response ids and per-step allowed ids the engine emits for this choice."""
        node, out, allowed = self.root, [], []
        for t in list(token_ids):
            if t not in node:
                raise ValueError("not one of the allowed choices")
            allowed.append(self.allowed(node))
            out.append(t)
            node = node[t]
        if not self.finished(node) and eos in node:  # a choice that prefixes another ends with EOS
            allowed.append(self.allowed(node))
            out.append(eos)
            node = node[eos]
        if not self.finished(node):
            raise ValueError("not one of the allowed choices (a prefix of one)")
        return out, allowed


def chat_prompt_ids(tokenizer, prompt, add_generation_prompt: bool = True) -> list[int]:
    """A prompt as the model sees it through its own chat template, ending with the assistant's generation prompt
    (an instruct model answers after it; without it, it may write the assistant header itself): an observation (one
    user message), chat messages as dicts, or (role, content) pairs (models/prompts.py)."""
    return list(
        tokenizer.apply_chat_template(as_chat(prompt), tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=False)
    )


def choice_trie(tokenizer, choices) -> ChoiceTrie:
    return ChoiceTrie([tokenizer.encode(c, add_special_tokens=False) for c in choices], tokenizer.eos_token_id)


def demo_sample(tokenizer, prompt: str, action: str, choices=None, max_tokens: int = 16, trie: ChoiceTrie | None = None) -> dict | None:
    """A demonstration turn as a trainer sample, or None when the engine could not have emitted
    it (not an allowed choice, or longer than ``max_tokens``)."""
    ids = tokenizer.encode(action, add_special_tokens=False)
    eos = tokenizer.eos_token_id
    if choices:
        try:
            response, allowed = (trie or choice_trie(tokenizer, choices)).walk(ids, eos)
        except ValueError:
            return None
    else:
        response, allowed = ids + [eos], None
    if len(response) > max_tokens:
        return None
    return {"prompt_ids": chat_prompt_ids(tokenizer, prompt), "response_ids": response, "allowed_ids": allowed}
