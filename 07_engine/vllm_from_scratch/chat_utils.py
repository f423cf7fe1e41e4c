"""A conversation in, the prompt's text and token ids out: the one chat rendering.

``LLM.chat`` and the OpenAI server's ``/v1/chat/completions`` both call :func:`render_chat`, so a
conversation becomes the same tokens offline and over HTTP (vLLM keeps the same in
``vllm/entrypoints/chat_utils.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

from vllm_from_scratch.errors import ParameterError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def render_chat(
    tokenizer: PreTrainedTokenizerBase | None,
    conversation: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> tuple[str, list[int]]:
    """The text of ``conversation`` through the tokenizer's chat template, and its token ids.

    ``conversation`` is a list of ``{"role", "content"}`` dicts. ``add_generation_prompt`` opens
    an assistant turn for the model to answer; ``continue_final_message`` instead leaves the last
    message open for the model to go on with (vLLM refuses both at once, and so do we).
    ``chat_template_kwargs`` are passed to the template (e.g. ``enable_thinking=False`` for
    Qwen3). ``tools`` (OpenAI's function definitions) go to the template, which writes them into
    the prompt in the model's own format (a template without tools ignores them). Raises
    :class:`ParameterError` naming ``messages`` when the checkpoint has no tokenizer or the
    template refuses the conversation.
    """
    if tokenizer is None:
        raise ParameterError("messages", "cannot be rendered: this checkpoint has no tokenizer (no chat template)")
    if add_generation_prompt and continue_final_message:
        raise ParameterError(
            "continue_final_message",
            "cannot be true with add_generation_prompt: a new assistant turn cannot continue the last message",
        )
    try:
        text = tokenizer.apply_chat_template(
            [dict(m) for m in conversation],
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tools=[dict(t) for t in tools] if tools else None,
            **dict(chat_template_kwargs or {}),
        )
    except Exception as exc:  # noqa: BLE001 - a template error is the messages' fault
        raise ParameterError("messages", f"cannot be rendered by the chat template: {exc}") from exc
    # tokenize=False returns the text (transformers types every mode's return at once); the
    # template already wrote the special tokens (BOS, role markers), so encode adds none.
    text = cast(str, text)
    return text, list(tokenizer.encode(text, add_special_tokens=False))
