"""The server renders prompts itself: OpenAI messages -> the model's chat template -> token ids.

Messages are normalised for Hugging Face templates (text parts joined, tool-call arguments as objects); an assistant
message the server returned is replaced by the raw text the model sampled (:mod:`.continuation`). Text is decoded with
every special token and no clean-up, so that decoded completions and rendered prompts are the same strings the ids
encode.

A fast tokenizer's encode and decode run on its Rust ``tokenizers.Tokenizer`` directly: for a short text the Python
wrapper costs about as much again as the encoding itself, a few times per call, and a server call is mostly such Python.
The wrapper's answers are checked against the direct ones on probe strings when the renderer is built
(:func:`direct_backend`); a tokenizer whose wrapper does anything more keeps going through it.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from typing import Any

from nemo_like.environments.agent import ContentError, content_text
from nemo_like.environments.tools.parsing import CLOSE_TAG, OPEN_TAG
from nemo_like.models.loading import added_around, render_chat, renders_tools
from nemo_like.serving.continuation import Continuations, RawLookup, message_keys, placed_keys
from nemo_like.serving.errors import bad_request, unsupported

log = logging.getLogger("nemo_like.serving")

ROLES = ("system", "developer", "user", "assistant", "tool")

#: Texts a session's prompt may continue with: encoded as a continuation, each must decode back as it is (a legacy
#: SentencePiece tokenizer adds a word-start ``▁`` in front of ``.a`` even behind the anchor).
CONTINUATION_PROBES = (".a", "a b", " a", "x\ny")
WORD_START = "\u2581"  # SentencePiece's word-start marker

#: Strings the direct path must encode and decode as the wrapper does: capitals, spaces at both ends and doubled, new lines,
#: non-ASCII text, markup around and between special tokens (each special token is probed too).
PROBES = (" Hello  WORLD ", "\n\nline\tend\n", "ünïcödé 中文 ✓", 'a<b>c</b> {"k": [1, 2]}', "x = 3.14*2 -> 6.28")


@functools.cache
def byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet inverted: the character a byte-level token writes for each byte -> that byte
    (``bytes_to_unicode``: printable bytes stand for themselves, the others for 256 + their rank)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # a SentencePiece byte-fallback piece


def _is_byte_level(tokenizer: Any) -> bool:
    """Whether the tokenizer is byte-level BPE (its tokens spell bytes in GPT-2's alphabet)."""
    if hasattr(tokenizer, "byte_decoder"):  # a slow GPT-2-style tokenizer
        return True
    backend = getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
    return backend is not None and type(getattr(backend, "decoder", None)).__name__ == "ByteLevel"


def direct_backend(tokenizer: Any) -> Any | None:
    """The Rust ``tokenizers.Tokenizer`` behind a fast ``tokenizer`` if calling it directly (``encode(text,
    add_special_tokens=False).ids`` and ``decode(ids, skip_special_tokens=False)``) gives the wrapper's ids and text on
    :data:`PROBES` and every special token alone, before and after text; None otherwise (a slow tokenizer, or a wrapper
    that adds processing of its own)."""
    backend = getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
    if backend is None or not hasattr(backend, "encode") or not hasattr(backend, "decode"):
        return None
    specials = list(getattr(tokenizer, "all_special_tokens", []) or [])
    probes = [*PROBES, *specials, *(f"a{t} b{t}" for t in specials), "".join(PROBES) + "".join(specials)]
    try:
        for text in probes:
            ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
            decoded = tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
            if backend.encode(text, add_special_tokens=False).ids != ids or backend.decode(ids, skip_special_tokens=False) != decoded:
                return None
    except Exception:  # a backend without these signatures: stay on the wrapper
        return None
    return backend


def _encodes_one_text_as_is(backend: Any) -> bool:
    """Whether the shared Rust backend encodes one text without truncating or padding it. Another caller of the
    wrapper may have left truncation, a fixed padding length or a padding multiple on it (the wrapper sets them per
    call and resets them on its next call); padding to the longest of a batch (the default of many tokenizer files)
    leaves one text as it is."""
    padding = backend.padding
    return backend.truncation is None and (padding is None or (padding["length"] is None and padding["pad_to_multiple_of"] is None))


def _without_word_start(node: Any) -> tuple[Any, bool]:
    """A normalizer or pre-tokenizer spec (a ``tokenizer.json`` entry) that adds no ``▁`` in front of a text: Metaspace
    prepends nothing and a ``Prepend`` of ``▁`` is dropped (None when that is all it was); and whether it changed."""
    if not isinstance(node, dict):
        return node, False
    if node.get("type") == "Prepend" and node.get("prepend") == WORD_START:
        return None, True
    if node.get("type") == "Metaspace" and node.get("prepend_scheme") != "never":
        return {**node, "prepend_scheme": "never"}, True
    for field in ("normalizers", "pretokenizers"):  # a Sequence
        if isinstance(node.get(field), list):
            parts = [_without_word_start(part) for part in node[field]]
            if any(changed for _, changed in parts):
                return {**node, field: [part for part, _ in parts if part is not None]}, True
    return node, False


def continuation_backend(backend: Any) -> Any | None:
    """A copy of a SentencePiece-style Rust ``backend`` that adds no word-start ``▁`` to a text (None: it adds none).

    A legacy one (Metaspace ``prepend_scheme: "always"``, or a ``Prepend`` normalizer as in Llama-2's
    ``tokenizer.json``) adds it in front of every stretch of text between special tokens, so the text behind the
    anchor of :meth:`Renderer.tokenize_continuation` gets a space it does not have. Behind the anchor the text never
    starts the input, so a copy that never adds the marker encodes it as its continuation."""
    spec = json.loads(backend.to_str())
    normalizer, normalizer_changed = _without_word_start(spec.get("normalizer"))
    pre_tokenizer, pre_tokenizer_changed = _without_word_start(spec.get("pre_tokenizer"))
    if not (normalizer_changed or pre_tokenizer_changed):
        return None
    copy = type(backend).from_str(json.dumps({**spec, "normalizer": normalizer, "pre_tokenizer": pre_tokenizer}))
    copy.no_truncation()
    copy.no_padding()
    return copy


def _text_content(content: Any, where: str) -> str:
    try:
        return content_text(content)
    except ContentError as exc:
        if exc.kind == "part":
            raise unsupported(f"{where}.content", "only text content parts") from None
        raise bad_request(f"'{where}.content' must be a string, a list of text parts or null.", param=f"{where}.content") from None


def _template_tool_calls(tool_calls: Any, where: str) -> list[dict[str, Any]]:
    """OpenAI tool calls with their argument strings decoded (what Hugging Face templates iterate over)."""
    if not isinstance(tool_calls, list):
        raise bad_request(f"'{where}.tool_calls' must be a list.", param=f"{where}.tool_calls")
    out = []
    for k, call in enumerate(tool_calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise bad_request(f"'{where}.tool_calls' entries need a 'function' with a 'name'.", param=f"{where}.tool_calls")
        arguments = function.get("arguments", "{}")
        try:
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
            json.dumps(arguments, allow_nan=False)  # NaN or inf (1e400 reads as inf), sent as text or as an object
        except (ValueError, TypeError, RecursionError):  # not JSON, nested past the recursion limit, 5,000 digits
            arguments = None
        if not isinstance(arguments, dict):  # a list, a number, null: the template would show the model that
            raise bad_request(
                f"'{where}.tool_calls[{k}].function.arguments' must be a JSON object (or a string holding one).",
                param=f"{where}.tool_calls",
            )
        out.append({"id": call.get("id"), "type": "function", "function": {"name": function["name"], "arguments": arguments}})
    return out


def normalize_message(message: Any, index: int, continuations: Continuations | None) -> dict[str, Any]:
    """One request message as the chat template gets it (raises a 400 naming ``messages[index]`` when malformed)."""
    return _normalize(message, index, continuations)[0]


def _normalize(message: Any, index: int, continuations: Continuations | None, context: str = "") -> tuple[dict[str, Any], RawLookup | None]:
    """:func:`normalize_message`, and for an assistant message in a session the raw-text lookup it depended on
    (``context``: the digest of the messages before it, :meth:`Continuations.history_digests`)."""
    where = f"messages[{index}]"
    if not isinstance(message, dict) or message.get("role") not in ROLES:
        raise bad_request(f"'{where}' needs a 'role' among {list(ROLES)}.", param=f"{where}.role")
    role = "system" if message["role"] == "developer" else message["role"]
    content = _text_content(message.get("content"), where)
    out: dict[str, Any] = {"role": role, "content": content}
    # A participant's name, any role (the template decides whether it renders it, as vLLM's server leaves it to it): it
    # was kept for tool messages only, so a multi-party prompt silently lost who said what.
    name = message.get("name")
    if name is not None and not isinstance(name, str):
        raise bad_request(f"'{where}.name' must be a string.", param=f"{where}.name")
    named = {"name": name} if name is not None else {}
    lookup = None
    if role == "assistant":
        tool_calls = message.get("tool_calls") or None
        if continuations is not None:
            keys = placed_keys(context, message_keys(content, tool_calls))  # the text, however sent (a string or parts)
            lookup = RawLookup(keys, continuations.raw_text(keys))
            if lookup.raw_text is not None:
                return {"role": "assistant", "content": lookup.raw_text, **named}, lookup
        if tool_calls:
            out["tool_calls"] = _template_tool_calls(tool_calls, where)
    if role == "tool" and isinstance(message.get("tool_call_id"), str):
        out["tool_call_id"] = message["tool_call_id"]
    return {**out, **named}, lookup


def with_calls_as_text(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant ``message`` whose ``tool_calls`` (template form) are written after its content as Hermes markup,
    ``<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>`` as Qwen's templates write them, which the server's
    ``hermes`` parser reads back: for a template that renders only ``content`` (a call would otherwise vanish from the
    prompt, the model no longer seeing what it asked for)."""
    calls = "".join(
        f"{OPEN_TAG}\n{json.dumps({'name': c['function']['name'], 'arguments': c['function']['arguments']})}\n{CLOSE_TAG}"
        for c in message["tool_calls"]
    )
    content = message.get("content") or ""
    return {**{k: v for k, v in message.items() if k != "tool_calls"}, "content": f"{content}\n{calls}" if content else calls}


#: A call only the template's rendering can spell: whether a template renders an assistant's tool calls (:class:`Renderer`).
PROBE_CALL_NAME = "nemo_like_probe_call_9b1c"


class Renderer:
    """Tokenizer + chat template (the tokenizer's own, or ``chat_template`` to override it)."""

    def __init__(self, tokenizer: Any, chat_template: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self._warned: set[str] = set()  # what the template does not render, logged once
        if chat_template is None and not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template; pass chat_template")
        self._direct = direct_backend(tokenizer)
        self._anchor = self._atomic_special_token()
        self._anchor_decoded = self.decode([self._anchor[0]]) if self._anchor is not None else ""  # its text as decoded
        self._rest_backend: Any | None = None  # encodes behind the anchor when the tokenizer's own adds a '▁' there
        if self._anchor is not None and not self._continues_exactly():
            self._rest_backend = self._exact_continuation_backend()
        self.text_prompt_prefix = list(added_around(tokenizer)[0])  # a BOS, or nothing

    def text_prompt_ids(self, text: str) -> list[int]:
        """The ids of a ``/v1/completions`` text prompt: its ids after the special tokens the tokenizer puts in front of
        a text (a Llama or Mistral tokenizer's BOS), as vLLM's completions endpoint adds them (``add_special_tokens``
        defaults to true there, false for chat, whose template writes them); not again when the text spells them."""
        ids = self.tokenize(text)
        prefix = self.text_prompt_prefix
        return ids if not prefix or ids[: len(prefix)] == prefix else [*prefix, *ids]

    @functools.cached_property
    def turn_end_id(self) -> int | None:
        """The token the template writes right after an assistant message's content (``<|im_end|>`` for ChatML), or
        None when it writes no special token there (or cannot render a probe conversation)."""
        probe = "\u2063probe\u2063"
        messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": probe}]
        try:
            text = render_chat(self.tokenizer, messages, chat_template=self.chat_template)
        except Exception:  # noqa: BLE001 - a template that refuses the probe: no end token is known
            return None
        after = text[text.rfind(probe) + len(probe) :] if probe in text else ""
        ids = self.tokenize(after) if after else []
        return ids[0] if ids and ids[0] in self._special_ids else None

    def _warn_once(self, what: str, consequence: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            log.warning(f"This model's chat template does not render {consequence}.")

    @functools.cached_property
    def renders_tools(self) -> bool:
        """Whether the template writes a request's ``tools`` into the prompt (many read only ``role`` and ``content``:
        the model then sees no tool list, and must know its tools already)."""
        return renders_tools(self.tokenizer, self.chat_template)

    @functools.cached_property
    def renders_tool_calls(self) -> bool:
        """Whether the template writes an assistant message's ``tool_calls`` (without it, a call the client sends back
        outside a session's recorded history would vanish from the prompt)."""
        # Its own name, rendered without tools: a template that lists the tools would spell the tool's name anyway
        call = {"type": "function", "function": {"name": PROBE_CALL_NAME, "arguments": {}}}
        messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
        try:
            return PROBE_CALL_NAME in render_chat(self.tokenizer, messages, chat_template=self.chat_template)
        except Exception:  # noqa: BLE001 - a template that refuses the probe renders none of it
            return False

    @functools.cached_property
    def max_token_chars(self) -> int:
        """An upper bound on the characters one token decodes to: its longest vocabulary entry's spelling (a byte-level
        token spells each byte as one character, a SentencePiece one its ``▁`` as the space it decodes to, a byte-fallback
        piece more characters than its byte), plus one for a word-start space a decoder may add. A text longer than
        ``n`` times this holds more than ``n`` tokens, whatever they are."""
        return max((len(token) for token in self.tokenizer.get_vocab()), default=1) + 1

    def tokenize(self, text: str) -> list[int]:
        """The ids of ``text`` (special-token markup included, no added BOS/EOS); a 400 for text UTF-8 cannot encode (a
        lone surrogate from a JSON ``\\ud800``: the tokenizer raised, a 500 the openai client retried)."""
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise bad_request("The request's text holds an unpaired UTF-16 surrogate (a lone \\ud800-\\udfff escape).") from None
        direct = self._direct
        if direct is not None and _encodes_one_text_as_is(direct):
            return direct.encode(text, add_special_tokens=False).ids
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def tokenize_continuation(self, text: str) -> list[int]:
        """The ids of ``text`` where it continues earlier ids (the rest of a session's prompt after the ids it reuses).

        Encoded on its own, a SentencePiece tokenizer starts ``text`` with its ``▁`` word marker, a space the rendered
        prompt does not have. So ``text`` is encoded behind an atomic special token (one id however it is followed),
        whose id is then dropped: the ids of ``text`` in context. Byte-level BPE gives the same ids either way. A legacy
        SentencePiece tokenizer adds the ``▁`` behind the special token too: then a :func:`continuation_backend` copy
        encodes it (decided when the renderer is built)."""
        if self._anchor is not None:
            anchor_id, anchor_text = self._anchor
            rest = self._rest_backend
            ids = rest.encode(anchor_text + text, add_special_tokens=False).ids if rest else self.tokenize(anchor_text + text)
            if ids and ids[0] == anchor_id:
                return ids[1:]
        return self.tokenize(text)

    def _continues_exactly(self) -> bool:
        """Whether every :data:`CONTINUATION_PROBES` text, encoded as a continuation, decodes back as it is."""
        return all(self.decode_continuation(self.tokenize_continuation(text)) == text for text in CONTINUATION_PROBES)

    def _exact_continuation_backend(self) -> Any | None:
        """A :func:`continuation_backend` that makes continuations exact, or None (logged: prompt ids after a reused
        prefix may then hold a space the client did not send, on masked-out tokens only)."""
        candidate = continuation_backend(self._direct) if self._direct is not None else None
        self._rest_backend = candidate  # tried by the probes
        exact = candidate is not None and self._continues_exactly()
        self._rest_backend = None
        if exact:
            return candidate
        log.warning(
            "This tokenizer adds a word-start space to a text behind a special token (a legacy SentencePiece "
            "tokenizer?) and the server found no exact way around it: a session's later prompts may encode a space the "
            "client did not send (in prompt tokens only, never in sampled ones)."
        )
        return None

    def decode_continuation(self, ids: list[int] | tuple[int, ...]) -> str:
        """The text ``ids`` add after earlier tokens (a completion after its prompt): decoded on their own, a
        SentencePiece tokenizer drops the space of a first ``▁`` piece, which the model sampled as part of the text.
        Decoded behind the atomic special token instead, whose text is then cut off."""
        if self._anchor is not None:
            text = self.decode([self._anchor[0], *ids])
            if text.startswith(self._anchor_decoded):
                return text[len(self._anchor_decoded) :]
        return self.decode(ids)

    def _atomic_special_token(self) -> tuple[int, str] | None:
        """A special token that encodes to its one id alone and in front of text (``None``: the tokenizer has none)."""
        for token in getattr(self.tokenizer, "all_special_tokens", []) or []:
            ids = self.tokenize(token)
            if len(ids) == 1 and self.tokenize(token + "a")[:1] == ids:
                return ids[0], token
        return None

    def decode(self, ids: list[int] | tuple[int, ...]) -> str:
        """The text of ``ids`` with every token, special ones included, without whitespace clean-up."""
        if self._direct is not None:
            return self._direct.decode(list(ids), skip_special_tokens=False)
        return self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token adds to the text (the ``bytes`` of chat ``logprobs``), also for a token holding part of
        a UTF-8 character, whose text decoded alone is U+FFFD: a byte-level BPE token's characters mapped back to their
        bytes, a SentencePiece byte-fallback piece (``<0xE2>``) its byte; any other token (a special token, a
        SentencePiece piece) the UTF-8 of its text as a continuation."""
        if token_id not in self._special_ids:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(piece, str):
                fallback = BYTE_FALLBACK.fullmatch(piece)
                if fallback is not None:
                    return bytes([int(fallback.group(1), 16)])
                if self._byte_level and piece and all(c in byte_level_decoder() for c in piece):
                    return bytes(byte_level_decoder()[c] for c in piece)
        return self.decode_continuation([token_id]).encode()

    @functools.cached_property
    def _special_ids(self) -> frozenset[int]:
        """Ids of the special and added tokens (spelled as their text, not in the byte alphabet)."""
        added = getattr(self.tokenizer, "added_tokens_decoder", None) or {}
        return frozenset([*added, *(getattr(self.tokenizer, "all_special_ids", None) or [])])

    @functools.cached_property
    def _byte_level(self) -> bool:
        return _is_byte_level(self.tokenizer)

    def chat_text(self, messages: list[Any], tools: list[dict[str, Any]] | None, continuations: Continuations | None) -> str:
        """The template's rendering of ``messages`` followed by the assistant generation prompt."""
        if continuations is None:
            normalized = [normalize_message(m, i, None) for i, m in enumerate(messages)]
        else:  # a session's history is normalised once, not again at every call
            normalized = continuations.normalized(messages, lambda m, i, context: _normalize(m, i, continuations, context))
        if any(m.get("tool_calls") for m in normalized) and not self.renders_tool_calls:
            normalized = [with_calls_as_text(m) if m.get("tool_calls") else m for m in normalized]
            self._warn_once("tool_calls", "an assistant's tool_calls: they are written into its content as Hermes text")
        if tools and not self.renders_tools:
            self._warn_once("tools", "'tools': the model sees none of the tools a request sends (its calls are still parsed)")
        try:
            return render_chat(
                self.tokenizer, normalized, tools=tools or None, add_generation_prompt=True, chat_template=self.chat_template
            )
        except Exception as exc:  # jinja's TemplateError / raise_exception: the request, not the server, is wrong
            raise bad_request(f"The chat template could not render these messages: {exc}", param="messages") from None
