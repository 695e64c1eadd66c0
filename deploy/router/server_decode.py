"""Server-only decoding of OpenAI requests (/v1/completions, /v1/chat/completions) over the
session protocol: ``mode: ar`` (empty trees) or ``mode: sd`` (:mod:`deploy.router.server_draft`).

All that can be refused is refused before a response starts; the session is closed however it ends (docs/router.md)."""

from __future__ import annotations

import asyncio
import contextvars
import logging

from fastapi.responses import JSONResponse

from deploy.router.tenants import TenantState
from specdec import openai as oai
from specdec.errors import SpecError
from specdec.openai.streaming import ClosingStream
from specdec.protocol import TokenLogprob, VerifyFrame

log = logging.getLogger("ray.serve")


class ServerDecode:
    """OpenAI generations decoded on the server through ``sessions`` (the Router: its ``open``, ``verify_frame``,
    ``close``); ``drafter``: an async callable that returns the server drafter (loaded once)."""

    def __init__(self, sessions, drafter):
        self.sessions = sessions
        self.drafter = drafter
        self._closing: set[asyncio.Task] = set()  # server-session closes in flight (see _close_shielded)

    async def respond(self, tenant: TenantState, req: oai.CompletionRequest, tok, info: dict,
                      versions: list[str], deadline_header: str | None = None, received_at: float | None = None):
        """The response to ``req`` (its ``model`` checked) for the verifier's ``info``; ``versions``: the target
        versions a ``model`` may name; ``deadline_header``, ``received_at``: as for :meth:`Router.open`."""
        req = req.with_max_tokens(info["max_model_len"])
        oai.check_sampling(req.sampling, info["vocab_size"])
        drafter = await self.drafter() if req.mode == "sd" else None
        version = req.model if req.model in versions else None
        rounds = self.rounds(tenant, req.prompt, req.sampling, drafter, version, deadline_header, received_at,
                             req.grammar)
        await anext(rounds)  # opens the server session
        deltas = oai.texts(rounds, tok, req.stop, req.tools)
        served = version or info["model"]
        headers = None
        if req.ignored:
            log.warning(oai.ignored_warning(req.ignored))
            headers = {oai.IGNORED_FIELDS_HEADER: ", ".join(req.ignored)}
        if req.stream:
            return ClosingStream(oai.sse(deltas, req, served, tok), media_type="text/event-stream", headers=headers)
        return JSONResponse(await oai.whole_response(deltas, req, served, tok), headers=headers)

    async def rounds(self, tenant: TenantState, prompt: list[int], sampling: dict, drafter,
                     version: str | None = None, deadline_header: str | None = None,
                     received_at: float | None = None, grammar=None):
        """Server-only decoding through the verifier: AR (empty trees) or with a server drafter.
        Yields a :class:`~specdec.openai.Round` per round, the first (no tokens) once the session is open;
        ``grammar``: the :class:`~specdec.grammar.GrammarSpec` the output follows."""
        # a drafter's trees are a client kind of their own for the replica's acceptance estimates
        client = {"draft": f"server/{getattr(drafter, 'name', type(drafter).__name__)}"[:128]} if drafter else {}
        body = {"prompt_ids": prompt, "sampling": sampling, "model": version, "client": client,
                "close_on_finish": True, **({"grammar": grammar.to_wire()} if grammar is not None else {})}
        opened = await self.sessions.open(tenant, body, deadline_header, received_at)
        sid, prefix_len = opened["session_id"], opened["prefix_len"]
        params = None
        if drafter is not None:  # the drafter samples its trees from the request's params (T > 0)
            from specdec.sampling import SamplingParams  # torch: only where a drafter runs anyway

            params = SamplingParams.from_dict(sampling)  # validated by the open
        history = list(prompt) + [opened["first_token"]]
        rounds, drafted, finish = 0, 0, None
        wants_logprobs = sampling.get("logprobs") is not None
        try:
            yield oai.Round([], None, {})
            finish = opened.get("finish_reason") if opened["finished"] else None
            cached = {"cached_tokens": opened.get("cached_tokens", 0)}  # prompt tokens the prefix cache held
            first_lp = [TokenLogprob.from_dict(opened["first_logprob"])] if wants_logprobs else None
            yield oai.Round([opened["first_token"]], finish, cached, first_lp)
            while finish is None:
                # a model drafter computes: keep it off the router's event loop
                tree, proposals = (await asyncio.to_thread(drafter.draft_round, list(history),
                                                           opened.get("budget_hint") or 8, params)
                                   if drafter else (None, None))  # proposals: tree rejection sampling (T > 0)
                tokens, parents = (list(tree.tokens), list(tree.parents)) if tree else ([], [])
                reply = await self.sessions.verify_frame(tenant, sid, VerifyFrame(prefix_len, tokens, parents,
                                                                                  proposals=proposals))
                new = reply.tokens(tokens)
                history.extend(new)
                prefix_len = reply.prefix_len
                rounds += 1
                drafted += len(tokens)
                finish = reply.finish_reason if reply.finished else None
                yield oai.Round(new, finish, {**cached, "rounds": rounds, "draft_tokens": drafted,
                                              "tokens_per_round": (len(history) - len(prompt) - 1) / max(rounds, 1)},
                                reply.token_logprobs(tokens))
        finally:
            if finish is None or not opened.get("close_on_finish"):
                await self._close_shielded(tenant, sid)

    async def _close_shielded(self, tenant: TenantState, sid: str) -> None:
        """Close a server session in a task of its own, shielded from the request's cancellation and context."""
        task = contextvars.Context().run(asyncio.get_running_loop().create_task, self._close_quietly(tenant, sid))
        self._closing.add(task)  # the loop keeps only weak references to tasks
        task.add_done_callback(self._closing.discard)
        await asyncio.shield(task)

    async def _close_quietly(self, tenant: TenantState, sid: str) -> None:
        try:
            await self.sessions.close(tenant, sid)
        except SpecError as e:  # already gone (evicted, timed out) or the verifier is down
            log.info("closing server session %s: %s", sid, e.message)
