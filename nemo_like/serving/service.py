"""One completion call, without HTTP: check it, render and tokenise the prompt, sample, record it in its session.

The HTTP layer (:mod:`.app`) only parses bodies and formats answers; everything that decides what is sampled and
recorded happens here, so the training loop's own tests can drive it directly.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any

from nemo_like.models.generation.interface import GeneratedSample, SamplingParams, stop_string_prefix
from nemo_like.serving.batching import GenerationQueue
from nemo_like.serving.continuation import message_keys
from nemo_like.serving.errors import ServingError, bad_request
from nemo_like.serving.protocol import GREEDY_BELOW, ChatCompletionRequest, CompletionRequest, SamplingFields, engine_top_k
from nemo_like.serving.rendering import Renderer
from nemo_like.serving.sessions import GREEDY_KEY, Session, SessionStore, call_settings
from nemo_like.serving.tool_parsers import ParsedTurn, ToolParser
from nemo_like.serving.trajectory import CallRecord

log = logging.getLogger("nemo_like.serving")


@dataclass(frozen=True)
class Limits:
    """What a request may ask for."""

    model_name: str
    max_context: int  # prompt + completion tokens
    max_n: int = 16
    require_session: bool = False  # refuse calls without a session id (a training run's server)
    run_sampling: RunSampling | None = None  # the run's sampling settings: defaults, enforced when ``enforce``; its stops
    min_temperature: float = 0.0  # the engine's lowest positive temperature (vLLM raises a lower one to its 0.01)


@dataclass(frozen=True)
class RunSampling:
    """A run's ``policy.generation`` settings. A request that leaves temperature / top_p / top_k unset gets the run's;
    with ``enforce`` (a training run's server, whose trainer scores every token under these settings) a request that
    sets another value, or greedy decoding, is refused: its recorded logprobs would not be those the trainer scores
    (a session opened with :data:`~.sessions.GREEDY_KEY` decodes greedily instead).

    Every call also stops at the run's ``stop_token_ids`` (they end the completion as eos does, and are not part of its
    text) and at its ``stop_strings`` besides the request's own ``stop``. ``max_new_tokens``: with ``enforce`` no call
    samples more (a longer ``max_tokens``, or none, is cut to it: ``finish_reason: "length"``), as no turn of an ordinary
    run does; without ``enforce`` it is the default of a chat call that sets no ``max_tokens``."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    enforce: bool = False
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    max_new_tokens: int | None = None

    def apply(self, req: SamplingFields, greedy: bool = False) -> None:
        """Fill ``req``'s unset fields with the run's values; with ``enforce`` refuse a differing one (400
        ``sampling_mismatch`` naming it). ``greedy`` (a session the run opened for greedy validation or eval): the call
        decodes greedily, whether it leaves ``temperature`` unset, sends 0 or the run's temperature (what an agent
        written for training sends)."""
        run = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k}
        for name, value in run.items():
            sent = getattr(req, name)
            if sent is None:
                setattr(req, name, value)
            elif greedy and name == "temperature" and sent == 0:
                pass
            elif self.enforce and (engine_top_k(sent) if name == "top_k" else sent) != value:  # temperature 0 stays 0
                raise bad_request(
                    f"'{name}'={sent} differs from the run's policy.generation.{name}={value}: the trainer scores every "
                    f"token under the run's settings, so this session's logprobs would not be the ones trained on. Leave "
                    f"'{name}' unset or send {value}.",
                    param=name,
                    code="sampling_mismatch",
                )
        if greedy:
            req.temperature = 0.0

    def max_tokens(self, requested: int | None, room: int) -> int:
        """The tokens a call may sample: ``requested`` (None: ``room``, the rest of the context), capped at the run's
        ``max_new_tokens`` with ``enforce``, defaulting to it without."""
        if self.max_new_tokens is None:
            return requested or room
        if self.enforce:
            return min(requested or room, self.max_new_tokens)
        return requested or min(room, self.max_new_tokens)

    def params(self, req: SamplingFields, max_new_tokens: int) -> SamplingParams:
        """The engine's settings of a call: the request's, with the run's stop tokens and stop strings added."""
        params = req.sampling_params(max_new_tokens, self.stop_token_ids)
        extra = tuple(s for s in self.stop_strings if s not in params.stop_strings)
        return replace(params, stop_strings=params.stop_strings + extra) if extra else params


def run_sampling(generation: Any, enforce: bool) -> RunSampling:
    """The :class:`RunSampling` of a recipe's ``policy.generation`` section."""
    return RunSampling(
        generation.temperature,
        generation.top_p,
        generation.top_k,
        enforce,
        stop_token_ids=tuple(generation.stop_token_ids or ()),
        stop_strings=tuple(generation.stop_strings or ()),
        max_new_tokens=generation.max_new_tokens,
    )


@dataclass
class SampledChoice:
    """One choice: the recorded ids and logprobs, the text returned and why it ended."""

    index: int
    completion_ids: list[int]
    logprobs: list[float]
    text: str  # the completion's text, cut before a stop string, without the end-of-turn token
    finish_reason: str  # "stop", "length" or "tool_calls"
    weight_version: int
    parsed: ParsedTurn | None = None  # chat: content and tool calls


@dataclass
class SampledCall:
    """A call's prompt ids and choices, and the session it was recorded in (None: not recorded)."""

    prompt_ids: list[int]
    choices: list[SampledChoice] = field(default_factory=list)
    session_id: str | None = None


def _cut_stop_string(text: str, stops: tuple[str, ...]) -> str:
    positions = [text.find(s) for s in stops if s in text]
    return text[: min(positions)] if positions else text


class CompletionService:
    """Renders, samples (through the :class:`~.batching.GenerationQueue`) and records calls."""

    def __init__(
        self,
        renderer: Renderer,
        queue: GenerationQueue,
        sessions: SessionStore,
        limits: Limits,
        eos_token_ids: list[int],
        tool_parser: ToolParser,
    ) -> None:
        self.renderer = renderer
        self.queue = queue
        self.sessions = sessions
        self.limits = limits
        run = limits.run_sampling
        # What ends a completion and is not part of its text: eos, and the run's stop tokens (policy.generation).
        self.eos_token_ids = set(eos_token_ids) | set(run.stop_token_ids if run is not None else ())
        # Of those, what the chat template writes back after an assistant message (eos, and a stop token that is the
        # template's own end of turn: <|im_end|> as a base model's stop): only these leave the raw text a later prompt
        # renders. A stop token such as '</tool_call>' is part of what the model wrote, and stays.
        self.end_of_turn_ids = set(eos_token_ids) | (self.eos_token_ids & {renderer.turn_end_id})
        self.tool_parser = tool_parser

    def _check(self, req: SamplingFields, session_id: str | None) -> None:
        req.check_supported()
        if req.model != self.limits.model_name:
            raise ServingError(
                404, f"The model '{req.model}' does not exist; this server serves '{self.limits.model_name}'.",
                type="not_found_error", code="model_not_found", param="model",
            )  # fmt: skip
        if req.n > self.limits.max_n:
            raise bad_request(f"'n' must be at most {self.limits.max_n}; got {req.n}.", param="n")
        greedy = session_id is not None and bool(self.sessions.session(session_id, make_room=False).metadata.get(GREEDY_KEY))
        if self.limits.run_sampling is not None:
            self.limits.run_sampling.apply(req, greedy)
        elif greedy:
            req.temperature = 0.0
        lowest = self.limits.min_temperature
        if req.temperature is not None and GREEDY_BELOW <= req.temperature < lowest:
            raise bad_request(
                f"'temperature' {req.temperature:g} is below {lowest:g}, the lowest this server's engine (vLLM) samples at "
                f"(it would sample at {lowest:g}); send 0 for greedy decoding, or at least {lowest:g}.",
                param="temperature",
            )

    def _session(self, session_id: str | None) -> tuple[Session | None, int]:
        if session_id is None:
            if self.limits.require_session:
                raise bad_request("This server records sessions: send 'X-Session-Id' or the 'user' field.", param="user")
            return None, 0
        return self.sessions.begin_call(session_id, make_room=False)

    async def _make_room(self) -> None:
        """End the sessions a new session's room needs (:meth:`~.sessions.SessionStore.make_room`), on a worker thread:
        it builds their rows, and on the event loop a long session's stalled every other request. After the call began
        (in flight, its own session is never the one ended)."""
        if self.sessions.room_pending:
            await asyncio.to_thread(self.sessions.make_room)

    def _max_tokens(self, prompt_len: int, requested: int | None, prompt_param: str) -> int:
        room = self.limits.max_context - prompt_len
        run = self.limits.run_sampling
        # The run's cap first: a training run's call that asks for more samples max_new_tokens ('length'), as documented
        wanted = (run.max_tokens(requested, room) if run is not None else requested or room) if room > 0 else requested or 0
        if room <= 0 or wanted > room:
            raise bad_request(
                f"This model's maximum context length is {self.limits.max_context} tokens. However, you requested "
                f"{prompt_len + wanted} tokens ({prompt_len} in the prompt, {wanted} for the completion).",
                param=prompt_param if room <= 0 else "max_tokens", code="context_length_exceeded",
            )  # fmt: skip
        return wanted

    def _refuse_overlong(self, text: str, prompt_param: str) -> None:
        """A prompt whose text is longer than the context's tokens can spell (:attr:`Renderer.max_token_chars` a
        token) is refused before it is tokenised: a 4 MB prompt took ~7 s of the server's tokeniser to find too long."""
        limit = self.limits.max_context * self.renderer.max_token_chars
        if len(text) > limit:
            raise bad_request(
                f"This model's maximum context length is {self.limits.max_context} tokens. However, your prompt's text is "
                f"{len(text)} characters, more than {self.limits.max_context} tokens can spell (at most "
                f"{self.renderer.max_token_chars} characters a token).",
                param=prompt_param, code="context_length_exceeded",
            )  # fmt: skip

    async def chat(self, req: ChatCompletionRequest, session_id: str | None) -> SampledCall:
        """Serve one ``/v1/chat/completions`` request."""
        self._check(req, session_id or req.user)
        session, call_index = self._session(session_id or req.user)
        try:
            await self._make_room()
            return await self._chat(req, session, call_index)
        finally:
            self._end_call(session)

    def _end_call(self, session: Session | None) -> None:
        if session is not None:
            self.sessions.end_call(session)

    async def _chat(self, req: ChatCompletionRequest, session: Session | None, call_index: int) -> SampledCall:
        continuations = session.continuations if session else None
        text = self.renderer.chat_text(req.messages, req.tools, continuations)
        self._refuse_overlong(text, "messages")
        ids = (
            continuations.prompt_ids(text, self.renderer.tokenize, self.renderer.tokenize_continuation)
            if continuations
            else self.renderer.tokenize(text)
        )
        call = await self._sample(req, text, ids, req.requested_max_tokens(), session, call_index, "messages")
        history = continuations.history_digests(req.messages)[-1] if continuations else ""  # what the choices answer
        for choice in call.choices:
            choice.parsed, whole = self._parse(req, choice.text)
            if choice.parsed.tool_calls and choice.finish_reason != "length":  # a cut turn says so, calls or not
                choice.finish_reason = "tool_calls"
            if continuations is not None and whole:
                keys = message_keys(choice.parsed.content, choice.parsed.tool_calls)
                continuations.remember_message(keys, self._raw_text(choice.completion_ids), history)
        return call

    def _parse(self, req: ChatCompletionRequest, text: str) -> tuple[ParsedTurn, bool]:
        """A choice's content and tool calls, and whether they are all the model wrote. With ``parallel_tool_calls:
        false`` only the first call is returned (as vLLM does); the raw text then holds calls the message does not,
        so the message is not mapped to it: sent back, it renders as the template writes it (the session branches)."""
        try:
            parsed = self.tool_parser(text) if req.parses_tools() else ParsedTurn(text)
        except Exception:  # noqa: BLE001 - a plug-in's bug: the call is recorded already, so no 500 (a retry records again)
            log.exception("rollout server: the tool parser raised; the completion is returned as content, without tool calls")
            parsed = ParsedTurn(text)
        if req.parallel_tool_calls is False and len(parsed.tool_calls) > 1:
            return ParsedTurn(parsed.content, parsed.tool_calls[:1]), False
        return parsed, True

    async def complete(self, req: CompletionRequest, session_id: str | None) -> SampledCall:
        """Serve one ``/v1/completions`` request (a text prompt, or token ids used as they are)."""
        self._check(req, session_id or req.user)
        session, call_index = self._session(session_id or req.user)
        try:
            await self._make_room()
            return await self._complete(req, session, call_index)
        finally:
            self._end_call(session)

    async def _complete(self, req: CompletionRequest, session: Session | None, call_index: int) -> SampledCall:
        if isinstance(req.prompt, str):
            text = req.prompt
            self._refuse_overlong(text, "prompt")
            ids = (
                session.continuations.prompt_ids(text, self.renderer.text_prompt_ids, self.renderer.tokenize_continuation)
                if session
                else self.renderer.text_prompt_ids(text)
            )
        else:
            vocab = self.sessions.vocab_size
            if vocab is not None and any(t < 0 or t >= vocab for t in req.prompt):
                raise bad_request(f"'prompt' holds token ids outside the vocabulary [0, {vocab}).", param="prompt")
            ids, text = list(req.prompt), self.renderer.decode(req.prompt)
        if not ids:  # "" tokenises to nothing (unless the tokenizer adds a BOS): there is no position to sample from
            raise bad_request("'prompt' must not be empty.", param="prompt")
        return await self._sample(req, text, ids, req.requested_max_tokens(), session, call_index, "prompt")

    def _raw_text(self, completion_ids: list[int], ending: set[int] | None = None) -> str:
        """The sampled text the template must render back: the completion without its end-of-turn token (``ending``:
        the ids dropped from its end instead; the returned text drops the run's stop tokens too)."""
        ending = self.end_of_turn_ids if ending is None else ending
        ids = completion_ids[:-1] if completion_ids and completion_ids[-1] in ending else completion_ids
        return self.renderer.decode_continuation(ids)

    async def _sample(
        self,
        req: SamplingFields,
        text: str,
        ids: list[int],
        requested: int | None,
        session: Session | None,
        call_index: int,
        prompt_param: str,
    ) -> SampledCall:
        max_new = self._max_tokens(len(ids), requested, prompt_param)
        settings = call_settings(self._params(req, max_new), req.n)  # as asked: its seed must not follow the budget's cut
        reserved = 0
        if session is not None:  # the call that reaches the budget ends there ('length'), it does not sample past it
            max_new, reserved = self.sessions.reserve(session, max_new, req.n)
        submitted: list[Future] = []  # the queue's future of the call, once submitted
        try:
            return await self._sample_reserved(req, text, ids, max_new, session, call_index, submitted, settings)
        except asyncio.CancelledError:  # its client left (app.unless_client_leaves): nothing is recorded
            if session is not None:
                self.sessions.abandon(session)
            raise
        finally:
            if reserved:
                self._release_once_sampled(session, reserved, submitted[0] if submitted else None)

    def _release_once_sampled(self, session: Session, reserved: int, submitted: Future | None) -> None:
        """Give back a call's reservation once the engine no longer samples it: now if it never reached the queue, is
        answered, or was dropped from the queue unsampled; else (a call cancelled while its engine call runs: the engine
        cannot stop it) when that engine call ends. Released at once, the client's retry reserved the budget again
        while the abandoned call was still sampling it: a session sampled several budgets."""
        if submitted is None or submitted.cancel() or submitted.done():
            self.sessions.release(session, reserved)
        else:
            submitted.add_done_callback(lambda _: self.sessions.release(session, reserved))

    def _params(self, req: SamplingFields, max_new: int) -> SamplingParams:
        run = self.limits.run_sampling
        return run.params(req, max_new) if run is not None else req.sampling_params(max_new)

    async def _sample_reserved(
        self,
        req: SamplingFields,
        text: str,
        ids: list[int],
        max_new: int,
        session: Session | None,
        call_index: int,
        submitted: list[Future],
        settings: str = "",
    ) -> SampledCall:
        """Sample the call (its queue future appended to ``submitted``) and record it in its session."""
        params = self._params(req, max_new)
        # A run's session samples with its own seeds: an agent's 'seed' would make a GRPO group's sessions identical
        # (without session seeds, agent.seeded_calls=false, the queue's running seeds apply). A call's seed follows its
        # prompt, not its arrival: a deterministic agent's concurrent calls sample the same on a rerun.
        session_seed = self.sessions.call_seed(session, ids, settings) if session is not None else None
        in_run = session is not None and self.limits.require_session
        seed = session_seed if session_seed is not None or in_run else req.seed
        caller = session.session_id if session else None
        submitted.append(self.queue.submit([ids] * req.n, params, seed, caller))
        samples: list[GeneratedSample] = await asyncio.wrap_future(submitted[-1])
        call = SampledCall(prompt_ids=list(ids), session_id=caller)
        records, texts = [], []
        for i, sample in enumerate(samples):
            choice = self._choice(i, sample, params)
            call.choices.append(choice)
            last_version = sample.kept_version(len(choice.completion_ids))  # a cut inside a longer draw: its kept tokens'
            records.append(
                CallRecord(
                    tuple(ids), tuple(choice.completion_ids), tuple(choice.logprobs), sample.weight_version,
                    sample.weight_version if last_version is None else last_version,
                    truncated=choice.finish_reason == "length", call_index=call_index, choice_index=i,
                    decoded_tokens=sample.num_decoded_tokens,
                )
            )  # fmt: skip
            texts.append((text, self.renderer.decode_continuation(choice.completion_ids)))
        if session is not None:
            self.sessions.record(session, records, texts)
        return call

    def _choice(self, index: int, sample: GeneratedSample, params: SamplingParams) -> SampledChoice:
        ids, logprobs, finish = list(sample.response_ids), list(sample.response_logprobs), "length" if sample.truncated else "stop"
        cut = self._stop_cut(ids, params)
        if cut is not None:
            ids, logprobs, finish = ids[:cut], logprobs[:cut], "stop"
        text = _cut_stop_string(self._raw_text(ids, self.eos_token_ids), params.stop_strings)
        return SampledChoice(index, ids, logprobs, text, finish, sample.weight_version)

    def _stop_cut(self, ids: list[int], params: SamplingParams) -> int | None:
        """Length of the shortest prefix of ``ids`` that ends at a stop token (an engine stops there itself) or whose
        text holds a stop string (whole tokens kept)."""
        stop_ids = set(params.stop_token_ids)
        at_token = next((i + 1 for i, t in enumerate(ids[:-1]) if t in stop_ids), None)
        ids = ids[:at_token] if at_token is not None else ids
        at_string = stop_string_prefix(ids, self.renderer.decode_continuation, params.stop_strings)
        return at_string if at_string is not None else at_token


def response_extras(call: SampledCall, choice: SampledChoice | None = None) -> dict[str, Any]:
    """The ``return_token_ids`` fields: the prompt's ids (per call) or a choice's ids and logprobs."""
    if choice is None:
        return {"prompt_token_ids": call.prompt_ids, "session_id": call.session_id}
    return {"completion_token_ids": choice.completion_ids, "completion_logprobs": choice.logprobs, "weight_version": choice.weight_version}
