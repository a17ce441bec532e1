"""The token ids a judge or a reward model reads: the policy's text stays text.

A chat template renders the scored prompt and response into one string; tokenizing that string whole turns any
special-token text inside the response (``<|im_end|>``, ``<|im_start|>assistant``) into the template's control tokens,
so a response could close the judge's turn and write the judge's verdict itself (a reward hack GRPO can find: the
policy only needs to spell the string with ordinary tokens). Here the template is rendered with a placeholder in place
of each message's content; the template's own text is tokenized as usual (its special tokens are real) and each
content with ``split_special_tokens=True`` (special-token strings in it stay plain text).
"""

from __future__ import annotations

from typing import Any

_PLACEHOLDER = "\ue000scored-content-{}\ue001"  # private-use characters: in no template's own text


def chat_ids_of_untrusted_text(tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool) -> list[int]:
    """The ids of ``messages`` through ``tokenizer``'s chat template, each message's content tokenized as plain text.

    Raises:
        ValueError: the template does not place each content once, as given (it rewrote or dropped a placeholder);
            the judge counts such a sample as a template error."""
    placeholders = [_PLACEHOLDER.format(i) for i in range(len(messages))]
    rendered = tokenizer.apply_chat_template(
        [{**m, "content": p} for m, p in zip(messages, placeholders)], add_generation_prompt=add_generation_prompt, tokenize=False
    )
    if any(rendered.count(p) != 1 for p in placeholders):
        raise ValueError("the chat template does not place each message's content once, as given")
    ids: list[int] = []
    rest = rendered
    for placeholder, message in zip(placeholders, messages):
        template_text, rest = rest.split(placeholder, 1)
        ids += tokenizer(template_text, add_special_tokens=False)["input_ids"] if template_text else []
        content = message["content"]
        ids += tokenizer(content, add_special_tokens=False, split_special_tokens=True)["input_ids"] if content else []
    ids += tokenizer(rest, add_special_tokens=False)["input_ids"] if rest else []
    return ids
