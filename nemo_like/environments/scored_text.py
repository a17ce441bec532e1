"""The token ids a judge or a reward model reads: the policy's text stays text.

A chat template renders the scored prompt and response into one string; tokenizing that string whole turns any
special-token text inside the response (``<|im_end|>``, ``<|im_start|>assistant``) into the template's control tokens,
so a response could close the judge's turn and write the judge's verdict itself (a reward hack GRPO can find: the
policy only needs to spell the string with ordinary tokens). Here the template is rendered with a placeholder in place
of each message's content, which finds each content's span in the real rendering. A rendering where no content
spells a special or added token's text is tokenized whole, as the template's own tokenization does (and as the reward
model saw in training: a BPE merge or a SentencePiece word start across a content's edge stays the template's); one
where a content does is tokenized piece by piece, the template's own text as usual (its special tokens are real) and
each content with ``split_special_tokens=True`` (special-token strings in it stay plain text).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from nemo_like.models.loading import added_token_texts, render_chat

_PLACEHOLDER = "\ue000scored-content-{}\ue001"  # private-use characters: in no template's own text


def chat_ids_of_untrusted_text(tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool) -> list[int]:
    """The ids of ``messages`` through ``tokenizer``'s chat template, each message's content tokenized as plain text.
    A template that transforms a content (``| trim``, a stripped newline) is followed: the content is read back from
    the real rendering between the template's own texts, so the ids are the template's for the real messages.

    Raises:
        ValueError: the template does not place each content once, or transforms it past recognition (more than
            the whitespace around it); the judge counts such a sample as a template error."""
    placeholders = [_PLACEHOLDER.format(i) for i in range(len(messages))]

    def render(contents: Sequence[str]) -> str:
        with_contents = [{**m, "content": c} for m, c in zip(messages, contents)]
        return render_chat(tokenizer, with_contents, add_generation_prompt=add_generation_prompt)

    marked = render(placeholders)
    if any(marked.count(p) != 1 for p in placeholders):
        raise ValueError("the chat template does not place each message's content once, as given")
    pieces = template_pieces(marked, render([m["content"] for m in messages]), placeholders, [m["content"] for m in messages])
    if pieces is None:
        raise ValueError("the chat template changes a message's content past its surrounding whitespace")
    return ids_of_pieces(tokenizer, pieces)


def template_pieces(marked: str, real: str, placeholders: Sequence[str], values: Sequence[str]) -> list[tuple[str, bool]] | None:
    """``real`` (a template rendered with ``values``) cut into ``(text, is_value)`` pieces, given ``marked``: the same
    template rendered with ``placeholders`` (each may appear any number of times). The values as given when they went
    in unchanged; else each read back between the template's own texts, accepted only when it equals its value but for
    the whitespace around it (``| trim``); ``None`` when the template's texts cannot be found so."""
    parts = re.split("(" + "|".join(re.escape(p) for p in placeholders) + ")", marked)
    texts, marks = parts[0::2], [placeholders.index(m) for m in parts[1::2]]
    if "".join(t + values[m] for t, m in zip(texts, marks)) + texts[-1] == real:  # the values went in as given
        pieces = [piece for t, m in zip(texts, marks) for piece in ((t, False), (values[m], True))] + [(texts[-1], False)]
        return [(text, is_value) for text, is_value in pieces if text]
    if not real.startswith(texts[0]) or not real.endswith(texts[-1]) or len(texts[0]) + len(texts[-1]) > len(real):
        return None
    pieces, position, end = [(texts[0], False)], len(texts[0]), len(real) - len(texts[-1])
    for i, m in enumerate(marks):
        following = texts[i + 1]
        if i == len(marks) - 1:
            found = end
        elif not following:  # two values with no template text between them: where one ends is unknown
            return None
        else:
            found = real.find(following, position, end)
        if found < 0 or real[position:found].strip() != values[m].strip():
            return None
        pieces += [(real[position:found], True), (following, False)]
        position = found + len(following)
    return [(text, is_value) for text, is_value in pieces if text]


def ids_of_pieces(tokenizer: Any, pieces: list[tuple[str, bool]]) -> list[int]:
    """The ids of the pieces' text: tokenized whole when no value spells a special or added token (the template's own
    ids), else the template's texts tokenized as usual (their special tokens are real) and the values as plain text."""
    if not value_spells_added_token(tokenizer, pieces):
        return tokenizer("".join(text for text, _ in pieces), add_special_tokens=False)["input_ids"]
    ids: list[int] = []
    for text, is_value in pieces:
        ids += tokenizer(text, add_special_tokens=False, split_special_tokens=is_value)["input_ids"]
    return ids


def value_spells_added_token(tokenizer: Any, pieces: list[tuple[str, bool]]) -> bool:
    """Whether a special or added token's text, wherever it stands in the joined pieces, takes a character of a value
    (inside one, or across its edge with the template's text): the whole text's tokenization would read it as that
    token."""
    text, spans, position = "".join(t for t, _ in pieces), [], 0
    for piece, is_value in pieces:
        if is_value:
            spans.append((position, position + len(piece)))
        position += len(piece)
    for token in added_token_texts(tokenizer):
        at = text.find(token)
        while at >= 0:
            if any(at < end and start < at + len(token) for start, end in spans):
                return True
            at = text.find(token, at + 1)
    return False
