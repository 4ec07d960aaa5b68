"""Chat prompts and conversations, rendered with the tokenizer's chat template (verl's ``RLHFDataset`` and multi-turn
SFT dataset).

A prompt is a string, used as it is, or a list of chat messages ``[{"role": ..., "content": ...}, ...]`` (what verl's
``examples/data_preprocess`` scripts write), rendered with ``tokenizer.apply_chat_template(messages, tokenize=False,
add_generation_prompt=True, **chat_template_kwargs)`` so the model's answer starts right after it.

An SFT conversation is a list of messages with at least one assistant turn; ``conversation_tokens`` tokenizes the
whole rendered conversation and marks the assistant turns (their content and the template's end-of-turn tokens) as
the loss targets, everything else (system, user, the template's role headers) as context.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

from rlworkers.tools.parsing import template_supports_tools, tools_system_prompt

ROLES = ("system", "user", "assistant", "tool")


def is_chat(prompt) -> bool:
    """Whether ``prompt`` is a list of chat messages (rather than a string)."""
    return isinstance(prompt, (list, tuple))


def check_messages(messages, where: str, column: str, *, need_assistant: bool = False) -> None:
    """Raise ``ValueError`` naming ``where`` (file and line/row) and ``column`` unless ``messages`` is a non-empty list
    of ``{"role", "content"}`` dicts with known roles and string contents (and, with ``need_assistant``, at least one
    assistant turn)."""
    if not messages:
        raise ValueError(f"{where}: column {column!r} is an empty list of messages. Fix: drop the row or fill it in")
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise ValueError(
                f"{where}: column {column!r}, message {index}: expected {{'role': ..., 'content': ...}}, got "
                f"{message!r}. Fix: write each chat message as a dict with 'role' and 'content'"
            )
        if message["role"] not in ROLES:
            raise ValueError(
                f"{where}: column {column!r}, message {index}: unknown role {message['role']!r}; use one of {ROLES}"
            )
        if not isinstance(message["content"], str):
            raise ValueError(
                f"{where}: column {column!r}, message {index}: content must be a string, got "
                f"{type(message['content']).__name__}"
            )
    if need_assistant and not any(message["role"] == "assistant" for message in messages):
        raise ValueError(
            f"{where}: column {column!r} has no assistant turn, so SFT has nothing to learn from it. Fix: add the "
            "assistant's reply, or drop the row"
        )


def _require_template(tokenizer) -> None:
    if not getattr(tokenizer, "chat_template", None):
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise ValueError(
            f"the dataset holds chat messages but the tokenizer of {name!r} has no chat template. Fix: use a chat "
            "(instruct) model, set tokenizer.chat_template in its tokenizer_config.json, or store the prompts as "
            "plain strings"
        )


def plain_messages(messages: Sequence[dict]) -> list[dict]:
    """Plain ``{"role", "content"}`` dicts (parquet structs may carry extra null fields, which templates print)."""
    return [{k: v for k, v in message.items() if v is not None} for message in messages]


def with_tools(messages: list[dict], tokenizer, chat_template_kwargs: dict | None) -> tuple[list[dict], dict]:
    """``(messages, chat_template_kwargs)`` to render: ``tools`` (OpenAI tool schemas) stay in the kwargs for a
    template that renders them; for one that ignores them (SmolLM2's ChatML) they are described in the system
    message instead (``rlworkers.tools.parsing.tools_system_prompt``), after the conversation's own system message
    when it has one."""
    kwargs = dict(chat_template_kwargs or {})
    if not kwargs.get("tools") or _renders_tools(tokenizer.chat_template, tokenizer):
        return messages, kwargs
    described = tools_system_prompt(kwargs.pop("tools"))
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": f"{messages[0]['content']}\n\n{described}"}, *messages[1:]], kwargs
    return [{"role": "system", "content": described}, *messages], kwargs


@lru_cache(maxsize=8)
def _renders_tools(chat_template: str, tokenizer) -> bool:
    return template_supports_tools(tokenizer)


def render_prompt(prompt, tokenizer, chat_template_kwargs: dict | None = None) -> str:
    """The text a prompt is tokenized from: a string as it is; chat messages through the chat template with the
    generation prompt appended.

    Raises:
        ValueError: chat messages and a tokenizer without a chat template.
    """
    if not is_chat(prompt):
        return prompt
    _require_template(tokenizer)
    messages, kwargs = with_tools(plain_messages(prompt), tokenizer, chat_template_kwargs)
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)


def prompt_token_ids(
    prompts: Sequence, tokenizer, chat_template_kwargs: dict | None = None
) -> tuple[list[str], list[list[int]]]:
    """Each prompt's text (``render_prompt``) and token ids: a string with the tokenizer's special tokens (a BOS,
    say), rendered chat messages without them (the template writes its own), as verl's ``RLHFDataset`` does. One
    tokenizer call per kind."""
    texts = [render_prompt(prompt, tokenizer, chat_template_kwargs) for prompt in prompts]
    ids: list[list[int]] = [[] for _ in prompts]
    for chat in (False, True):
        where = [i for i, prompt in enumerate(prompts) if is_chat(prompt) == chat]
        if where:
            encoded = tokenizer([texts[i] for i in where], add_special_tokens=not chat)["input_ids"]
            for i, one in zip(where, encoded):
                ids[i] = list(one)
    return texts, ids


def conversation_tokens(
    messages: Sequence[dict], tokenizer, chat_template_kwargs: dict | None = None
) -> tuple[list[int], list[int]]:
    """``(input_ids, loss_mask)`` of a whole conversation: loss_mask is 1 on the tokens of every assistant turn.

    A turn's tokens are the difference between the conversation rendered up to it (with the generation prompt, so
    the assistant's role header is context) and rendered through it. This needs a template whose rendering of a
    conversation starts with its rendering of every shorter one (ChatML, Llama 3 and most others).

    Raises:
        ValueError: no chat template, or a template that renders a shorter conversation as something other than a
            prefix of the longer one (the message says which turn).
    """
    _require_template(tokenizer)
    messages, kwargs = with_tools(plain_messages(messages), tokenizer, chat_template_kwargs)

    def render(upto: int, generation_prompt: bool) -> str:
        return tokenizer.apply_chat_template(
            messages[:upto], tokenize=False, add_generation_prompt=generation_prompt, **kwargs
        )

    text = render(len(messages), False)
    # (start, end) character spans of the assistant turns; tokens are then assigned by their character offsets
    spans = []
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before, through = render(index, True), render(index + 1, False)
        if not (text.startswith(through) and through.startswith(before)):
            raise ValueError(
                f"the chat template does not render conversations turn by turn (turn {index} changes the text "
                "before it), so the assistant turns cannot be located. Fix: use prompt/response columns instead"
            )
        spans.append((len(before), len(through)))
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    loss_mask = [
        int(any(start <= token_start < end for start, end in spans)) for token_start, _ in encoded["offset_mapping"]
    ]
    return list(encoded["input_ids"]), loss_mask


def conversation_as_prompt(row: dict, prompt_key: str, conversation_key: str) -> dict:
    """A row to validate on: a prompt row as it is; an SFT conversation as its messages before the last assistant
    turn (the prompt) and that turn's content as the ``ground_truth`` (unless the row has one)."""
    messages = row.get(conversation_key)
    if row.get(prompt_key) is not None or messages is None:
        return row
    last = max(i for i, message in enumerate(messages) if message["role"] == "assistant")
    return {"ground_truth": messages[last]["content"], **row, prompt_key: list(messages[:last])}
