"""Token ids as the model's own tokenizer makes them: the one place that turns text into ids for the trainer,
the decode engine and `harli-train generate`.

Special tokens follow the tokenizer's rules, never a rule of ours: plain text gets what
`encode(text, add_special_tokens=True)` adds (a Llama tokenizer's BOS, nothing for a ChatML one, the byte
tokenizer's BOS), and a conversation gets exactly what its chat template writes (the rendered text is
encoded with no special tokens added, so a template that writes `bos_token` gets one BOS, not two). A prompt
and its completion are tokenized together, as TRL and axolotl do, so the ids trained on are the ids the model
would see at inference; the loss mask falls at the prompt's length.
"""

from __future__ import annotations

from harli_train.data.example import IGNORE_INDEX, DataError, Example
from harli_train.data.tokenizer import ChatTokenizer, Tokenizer

TRAIN_ON = ("assistant", "all")


def prompt_ids(tokenizer: Tokenizer, text: str) -> list[int]:
    """The ids a text prompt is fed to the model as (generation): its tokens with the tokenizer's special
    tokens, as `transformers` tokenizes a prompt by default."""
    return tokenizer.encode(text, add_special_tokens=True)


def chat_prompt_ids(tokenizer: Tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """The ids of a conversation rendered by the tokenizer's chat template, followed by the template's
    generation prompt (the opening of the assistant's turn): what a chat model is fed to answer. DataError
    naming the tokenizer when it has no chat template."""
    chat = chat_tokenizer(tokenizer)
    return chat.encode(chat.render_chat(messages, add_generation_prompt=True))


def prompt_completion_example(tokenizer: Tokenizer, prompt: str, completion: str) -> Example:
    """`prompt + completion` tokenized as one text with the tokenizer's special tokens, EOS appended unless
    the tokenizer put it last, and the loss on everything after the prompt.

    The prompt's length is the number of leading tokens that `prompt` alone tokenizes to: a token that
    merges across the boundary carries completion text, so it is learned.
    """
    head = tokenizer.encode(prompt, add_special_tokens=True)
    ids = tokenizer.encode(prompt + completion, add_special_tokens=True)
    if not ids or ids[-1] != tokenizer.eos_id:
        ids.append(tokenizer.eos_id)
    n = _common_prefix(head, ids)
    return Example(ids, [IGNORE_INDEX] * n + ids[n:])


def text_example(tokenizer: Tokenizer, text: str) -> Example:
    """A plain text to learn whole: the tokenizer's leading special tokens (BOS) are not learned."""
    return prompt_completion_example(tokenizer, "", text)


def chat_example(
    tokenizer: Tokenizer, messages: list[dict[str, str]], train_on: str = "assistant"
) -> Example:
    """A conversation rendered by the tokenizer's chat template; the loss on the assistant turns
    (`train_on="assistant"`) or on every token (`"all"`).

    An assistant turn is learned from its first token through the template's end-of-turn token
    (`<|eot_id|>`, `<|im_end|>`); whitespace the template writes after that is not. A template with
    {% generation %} blocks says itself which tokens are the assistant's (transformers'
    `return_assistant_tokens_mask`); for others the turns are located by rendering the conversation turn by
    turn (`assistant_spans`). DataError when there is no template, when the template refuses the
    conversation, or when no token is learned.
    """
    if train_on not in TRAIN_ON:
        raise ValueError(f"train_on must be one of {', '.join(TRAIN_ON)}, got {train_on!r}")
    chat = chat_tokenizer(tokenizer)
    if train_on == "all":
        ids = chat.encode(chat.render_chat(messages, add_generation_prompt=False))
        mask = [1] * len(ids)
    elif chat.has_generation_tags:
        ids, mask = chat.assistant_tokens_mask(messages)
    else:
        text = chat.render_chat(messages, add_generation_prompt=False)
        ids, offsets = chat.encode_with_offsets(text)
        mask = _overlap_mask(offsets, assistant_spans(chat, messages, text))
    if not any(mask):
        raise DataError("the conversation has no assistant text to learn (data.train_on: assistant)")
    return Example(ids, [t if m else IGNORE_INDEX for t, m in zip(ids, mask, strict=True)])


def assistant_spans(chat: ChatTokenizer, messages: list[dict[str, str]], text: str) -> list[tuple[int, int]]:
    """Character spans [start, end) of the assistant turns in `text`, the whole conversation as rendered.

    Turn i starts where the conversation up to it, rendered with the generation prompt, ends, and stops
    where the conversation through it ends, less trailing whitespace. Both renderings must be prefixes of
    `text`; a template that rewrites earlier turns as the conversation grows breaks that (DataError).
    """
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = chat.render_chat(messages[:i], add_generation_prompt=True)
        through = chat.render_chat(messages[: i + 1], add_generation_prompt=False)
        if not (text.startswith(before) and text.startswith(through) and len(before) <= len(through)):
            raise DataError(
                f"the chat template of {chat.source} does not render a conversation's turns as a prefix of "
                f"the whole (it rewrites turn {i + 1} or those before it), so the assistant's tokens "
                "cannot be located; use a template with {% generation %} blocks, or data.train_on: all"
            )
        spans.append((len(before), max(len(before), len(through.rstrip()))))
    return spans


def chat_tokenizer(tokenizer: Tokenizer) -> ChatTokenizer:
    """`tokenizer` itself, once it is known to have a chat template; DataError naming it otherwise."""
    if tokenizer.chat_template is None:
        raise DataError(
            f"{tokenizer.source}: the tokenizer has no chat template (tokenizer_config.json 'chat_template' "
            "or chat_template.jinja); chat, alpaca and sharegpt data and generate --chat need one"
        )
    return tokenizer  # type: ignore[return-value]  # a tokenizer with a template implements ChatTokenizer


def _overlap_mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    """1 for each token whose characters overlap one of `spans` (both in order), as transformers marks the
    tokens of {% generation %} blocks."""
    mask, s = [0] * len(offsets), 0
    for t, (start, end) in enumerate(offsets):
        while s < len(spans) and start >= spans[s][1]:
            s += 1
        if s == len(spans):
            break
        if end > spans[s][0]:
            mask[t] = 1
    return mask


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
