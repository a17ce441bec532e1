"""The token ids a judge or a reward model reads: the policy's text stays text.

A chat template renders the scored prompt and response into one string; tokenizing that string whole turns any
special-token text inside the response (``<|im_end|>``, ``<|im_start|>assistant``) into the template's control tokens,
so a response could close the judge's turn and write the judge's verdict itself (a reward hack GRPO can find: the
policy only needs to spell the string with ordinary tokens). Here the template is rendered with a placeholder in place
of each message's content, which finds each content's span in the real rendering. A rendering whose whole
tokenization forms no special token from a content's characters keeps those ids, the template's own (what the reward
model saw in training: a BPE merge or a SentencePiece word start across a content's edge stays the template's); one
that does is tokenized piece by piece, the template's own text as usual (its special tokens are real) and
each content with ``split_special_tokens=True`` (special-token strings in it stay plain text).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from nemo_like.models.loading import render_chat

_PLACEHOLDER = "\ue000scored-content-{}\ue001"  # private-use characters: in no template's own text


class ContentRewrittenError(ValueError):
    """A chat template does not place a message's content once, as given (it drops reasoning before ``</think>``,
    moves it into a block, ...): the content cannot be kept as plain text."""


def chat_ids_of_untrusted_text(tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool) -> list[int]:
    """The ids of ``messages`` through ``tokenizer``'s chat template, each message's content tokenized as plain text.
    A template that transforms a content (``| trim``, a stripped newline) is followed: the content is read back from
    the real rendering between the template's own texts, so the ids are the template's for the real messages.

    Raises:
        ContentRewrittenError: the template does not place each content once, or transforms it past recognition (more
            than the whitespace around it); the judge and the reward model count such a sample as a template error."""
    placeholders = [_PLACEHOLDER.format(i) for i in range(len(messages))]

    def render(contents: Sequence[str]) -> str:
        with_contents = [{**m, "content": c} for m, c in zip(messages, contents)]
        return render_chat(tokenizer, with_contents, add_generation_prompt=add_generation_prompt)

    marked = render(placeholders)
    if any(marked.count(p) != 1 for p in placeholders):
        raise ContentRewrittenError("the chat template does not place each message's content once, as given")
    pieces = template_pieces(marked, render([m["content"] for m in messages]), placeholders, [m["content"] for m in messages])
    if pieces is None:
        raise ContentRewrittenError("the chat template changes a message's content past its surrounding whitespace")
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
    """The ids of the pieces' text: its whole tokenization (the template's own ids) when no special token in it takes a
    character of a value, else the template's texts tokenized as usual (their special tokens are real) and the values
    as plain text."""
    whole = whole_ids_without_control_in_values(tokenizer, pieces)
    if whole is not None:
        return whole
    ids: list[int] = []
    for text, is_value in pieces:
        ids += tokenizer(text, add_special_tokens=False, split_special_tokens=is_value)["input_ids"]
    return ids


def whole_ids_without_control_in_values(tokenizer: Any, pieces: list[tuple[str, bool]]) -> list[int] | None:
    """The joined pieces' ids, tokenized whole, when none of their special tokens (but the unknown token) spans a
    character of a value; ``None`` when one does, or the tokenizer gives no character offsets (a slow one). The
    tokenizer's own offsets decide, so tokens it matches after normalising the text (NFKC: a full-width
    ``＜｜im_end｜＞``) or across a value's edge are found where a search for the token's text is not."""
    if not getattr(tokenizer, "is_fast", False):
        return None
    spans, position = [], 0
    for text, is_value in pieces:
        if is_value:
            spans.append((position, position + len(text)))
        position += len(text)
    text = "".join(text for text, _ in pieces)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    control = control_token_ids(tokenizer)
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    for token, (start, end) in zip(encoded["input_ids"], encoded["offset_mapping"]):
        if token in control:
            start, end = own_characters(text, start, end, added.get(token))
            if any(start < value_end and value_start < end for value_start, value_end in spans):
                return None
    return list(encoded["input_ids"])


def own_characters(text: str, start: int, end: int, added: Any) -> tuple[int, int]:
    """The span of a special token's own characters in ``text[start:end]``, its offsets: an ``lstrip``/``rstrip`` added
    token's offsets also hold the whitespace it absorbed (Phi-3's ``<|assistant|>`` before a response starting with a
    space), which is no content forming it. Only what the token's flags absorb, and no more than its offsets hold
    beyond its text, is left out (a token whose text is whitespace keeps it)."""
    spelled, content = text[start:end], getattr(added, "content", None)
    extra = len(spelled) - len(content) if content else 0
    if extra <= 0:
        return start, end
    leading = _leading_space(spelled) - _leading_space(content) if getattr(added, "lstrip", False) else 0
    leading = min(max(leading, 0), extra)
    trailing = _leading_space(spelled[::-1]) - _leading_space(content[::-1]) if getattr(added, "rstrip", False) else 0
    return start + leading, end - min(max(trailing, 0), extra - leading)


def _leading_space(text: str) -> int:
    return len(text) - len(text.lstrip())


def control_token_ids(tokenizer: Any) -> frozenset[int]:
    """The ids ``split_special_tokens`` keeps a text from forming: the special tokens, the unknown token aside."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    special = {i for i, token in added.items() if getattr(token, "special", False)} | set(tokenizer.all_special_ids)
    return frozenset(special - {tokenizer.unk_token_id})
