"""``edge-agent``: generate text with a local draft and a remote (or in-process) verifier.

Exit status 2: a usage, connection, auth or compatibility problem, explained in one line.
Notes: docs/edge_agent.md, "edge_agent/cli.py"."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys

from edge_agent.agent import EdgeAgent
from edge_agent.config import MAX_GUESSES, MODES, VERIFY_RULES, AgentConfig
from edge_agent.depth import POLICIES
from specdec import clock
from specdec.version import package_version

DRAFT_HELP = ("draft model: 'ngram' (prompt lookup, no model), 'embedded-draft' (the project's trained draft "
              "for SmolLM2), 'embedded' (SmolLM2 itself), 'tiny-random' (random tiny Llama, tests), "
              "'none' (no draft: plain decoding), an HF directory, a .gguf file, or a draft artifact "
              "(.safetensors with vocab_map)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="edge-agent", description=__doc__.split("\n")[0])
    p.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    sub = p.add_subparsers(dest="command", required=True)

    def server_opts(sp):
        sp.add_argument("--server", help="server base URL, e.g. http://127.0.0.1:8000")
        sp.add_argument("--api-key", default=os.environ.get("SPECEDGE_API_KEY"),
                        help="tenant API key (default: $SPECEDGE_API_KEY)")
        sp.add_argument("--ws", action=argparse.BooleanOptionalAction, default=True,
                        help="verify over a per-session WebSocket (default; cheaper per round) or, with --no-ws, "
                             "HTTP POST")
        sp.add_argument("--timeout", type=float, default=60.0, help="per-request timeout in seconds")

    info = sub.add_parser("info", help="show the server's model and limits")
    server_opts(info)

    g = sub.add_parser("generate", help="generate text")
    server_opts(g)
    g.add_argument("--local", action="store_true", help="run the verifier in this process (no server)")
    g.add_argument("--target", default="embedded", help="--local: target model spec (see load_model)")
    g.add_argument("--rtt-ms", type=float, default=0.0, help="--local: simulated network RTT")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-ids", help="prompt as comma-separated token ids (no tokenizer needed)")
    fmt = g.add_mutually_exclusive_group()
    fmt.add_argument("--chat", action="store_true",
                     help="wrap --prompt in the tokenizer's chat template (the default when it has one; an error "
                          "when it has none)")
    fmt.add_argument("--raw", action="store_true",
                     help="send --prompt as bare text, not wrapped in the tokenizer's chat template")
    g.add_argument("--model", help="target version to verify against (a name of the server's target.adapters); "
                                   "default: the base")
    agent_opts(g)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int)
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--stop-ids", default="", help="comma-separated stop token ids")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--json", action="store_true", help="print one JSON object (text, ids, stats) and nothing else")
    g.add_argument("--metrics-port", type=int, help="expose Prometheus metrics on 127.0.0.1:PORT (edge_agent.metrics)")
    g.add_argument("--metrics-linger", type=float, default=0.0,
                   help="seconds to keep serving metrics after the generation (for a scrape)")

    s = sub.add_parser("serve", help="a local OpenAI server (/v1/chat/completions, /v1/completions, /v1/models) "
                                     "drafting here, verified by the server")
    server_opts(s)
    agent_opts(s)
    s.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    s.add_argument("--port", type=int, default=8100, help="port (0: any free one, printed at start)")
    s.add_argument("--max-concurrency", type=int, default=8,
                   help="generations at once (each holds a draft KV cache; more requests wait their turn)")
    return p


def agent_opts(g) -> None:
    """The draft and how the agent drafts and verifies (``generate`` and ``serve``)."""
    g.add_argument("--predraft", action="store_true",
                   help="early-exit pre-drafting: when the server has exit heads (GET /v1/model lists early_exit_layers), "
                        "draft the next tree from its early results mid-round (WebSocket, or streamed HTTP POST with --no-ws)")
    g.add_argument("--guesses", type=int, default=AgentConfig.guesses, choices=range(MAX_GUESSES + 1),
                   metavar=f"0..{MAX_GUESSES}",
                   help="proactive mode: also draft the next tree for this many of a round's likeliest outcomes, by "
                        "the draft's own estimate, while the reply is away (default 0: SpecEdge's proactive chain only)")
    g.add_argument("--no-run-ahead", dest="run_ahead", action="store_false",
                   help="one token per round trip while the server says trees do not pay (default: let it decode "
                        "on and reply with several tokens, F_AHEAD)")
    g.add_argument("--draft", default="ngram", help=DRAFT_HELP)
    g.add_argument("--draft-seed", type=int, default=0, help="seed of a tiny-random draft")
    g.add_argument("--tokenizer", help="tokenizer spec (default: the draft's, else the embedded one)")
    g.add_argument("--device", default="auto", help="draft device: auto, cpu, cuda, mps")
    g.add_argument("--dtype", default="auto", help="draft (and --local target) dtype: auto, float32, bfloat16")
    g.add_argument("--mode", choices=MODES, default="proactive")
    g.add_argument("--verify", choices=VERIFY_RULES, default="match",
                   help="match: draft trees, the server samples and follows matching children (no draft "
                        "probabilities sent); rejection: draft chains sampled from the draft with q(x) per token, "
                        "split rejection sampling (DSSD/PicoSpec), more tokens per round at temperature > 0; "
                        "tree-rejection: trees whose siblings are drawn without replacement from a sparse q sent "
                        "with the tree, the server samples every residual (multi-draft rejection sampling); "
                        "auto: greedy -> match, sampled -> the rule with the most tokens per verify round at that "
                        "temperature (a prior from the measured benchmark, then this agent's measurements)")
    g.add_argument("--verify-state", metavar="PATH",
                   help="--verify auto: JSON file keeping the measured acceptance per (target, draft) across runs "
                        "(default: $XDG_CACHE_HOME/specedge/verify_policy.json, else ~/.cache/...)")
    g.add_argument("--no-verify-state", action="store_true",
                   help="--verify auto: keep the measurements in this process only (no state file)")
    g.add_argument("--depth-policy", choices=POLICIES, default="auto")
    g.add_argument("--depth", type=int, default=4, help="fixed depth / default before measurements")
    g.add_argument("--max-depth", type=int, default=12)
    g.add_argument("--budget", type=int, default=32, help="draft-tree nodes")
    g.add_argument("--topk", type=int, default=4, help="children per expanded node (1 = chain)")
    g.add_argument("--max-expand", type=int, default=8, help="nodes expanded per draft forward")


def _ids(s: str) -> list[int]:
    return [int(x) for x in s.replace(" ", "").split(",") if x]


def load_tokenizer(spec: str):
    from transformers import AutoTokenizer

    from specdec.model.loading import EMBEDDED_ALIASES, ensure_embedded_model

    if spec in ("none", ""):
        return None
    path = ensure_embedded_model() if spec in EMBEDDED_ALIASES else spec
    return AutoTokenizer.from_pretrained(str(path))


def load_drafter(spec: str, *, device: str, dtype: str, seed: int, vocab_size: int | None):
    """(drafter, tokenizer or None) for a ``--draft`` spec."""
    from edge_agent.draft_backends import ModelDrafter, NgramDrafter, NullDrafter
    from specdec.model.loading import EMBEDDED_ALIASES, TINY_PREFIX, load_model

    if spec == "ngram":
        return NgramDrafter(), None
    if spec == "none":
        return NullDrafter(), None
    if spec == "embedded-draft" or spec.endswith(".safetensors"):
        try:
            from edge_agent.embedded_draft import load_draft
        except ImportError as e:
            raise SystemExit(f"error: the embedded draft is not available in this installation ({e})")
        try:
            model = load_draft(None, spec, dtype=dtype, device=device)
        except FileNotFoundError as e:
            raise SystemExit(f"error: draft artifact not found: {e}")
        return ModelDrafter(model, name=spec), load_tokenizer("embedded")
    if spec.startswith(TINY_PREFIX):
        cfg = {"vocab_size": vocab_size} if vocab_size else None
        lm = load_model(spec, dtype="float32" if dtype == "auto" else dtype, device=device, seed=seed,
                        tiny_config=cfg)
        return ModelDrafter(lm.model, name=lm.name), None
    if spec not in EMBEDDED_ALIASES and not os.path.exists(spec):
        raise SystemExit(f"error: draft {spec!r} is neither a known name nor an existing path ({DRAFT_HELP})")
    lm = load_model(spec, dtype=dtype, device=device)
    return ModelDrafter(lm.model, name=lm.name), lm.tokenizer


def _prompt(a, tok) -> str | list[int]:
    """What to generate from: ``--prompt-ids`` as given; ``--prompt`` as one user message through the
    tokenizer's chat template when it has one (as vLLM's ``LLM.chat``, and the edge server's
    /v1/chat/completions, with the same function), else, or with ``--raw``, the bare text."""
    from specdec.errors import InvalidRequest
    from specdec.openai import chat_prompt

    if a.prompt is None:
        return _ids(a.prompt_ids)
    if a.raw or not (a.chat or getattr(tok, "chat_template", None)):
        return a.prompt
    try:
        return chat_prompt([{"role": "user", "content": a.prompt}], tok)
    except InvalidRequest as e:  # --chat without a template, or a template refusing one user message
        raise SystemExit(f"error: {e.message}; --raw sends the bare prompt") from None


def _sampling(a) -> dict:
    return {"temperature": a.temperature, "top_p": a.top_p, "top_k": a.top_k, "seed": a.seed,
            "max_tokens": a.max_tokens, "stop_token_ids": _ids(a.stop_ids), "ignore_eos": a.ignore_eos}


def _verify_state(a) -> str | None:
    """The state file of ``--verify auto`` (edge_agent.verify_policy.PolicyStore), or None."""
    from edge_agent.verify_policy import default_state_path

    if a.verify != "auto" or a.no_verify_state:
        return None
    return a.verify_state or str(default_state_path())


def _transport(a):
    from edge_agent.transport import HttpTransport

    if not a.server:
        raise SystemExit("error: give --server URL (or --local to run the verifier in this process)")
    return HttpTransport(a.server, api_key=a.api_key, ws=a.ws, timeout_s=a.timeout)


def _local_transport(a):
    from edge_agent.transport import LocalTransport
    from specdec.engine import VerifierEngine
    from specdec.model.loading import load_model, tokenizer_fingerprint
    from specdec.tree import TreeLimits

    lm = load_model(a.target, dtype=a.dtype, device="cpu")
    engine = VerifierEngine(lm.model, eos_token_ids=lm.eos_token_ids, limits=TreeLimits(max_nodes=max(64, a.budget)))
    return LocalTransport(engine, model_name=lm.name, tokenizer_fingerprint=tokenizer_fingerprint(lm.tokenizer),
                          rtt_ms=a.rtt_ms, max_depth=a.max_depth, tokenizer=lm.tokenizer), lm.tokenizer


async def _info(a) -> int:
    async with _transport(a) as t:
        info = await t.model_info()
    print(json.dumps(info.__dict__, indent=2))
    return 0


def _draft_and_tokenizer(a, info, local_tok=None):
    """The ``--draft`` (loaded once) and the tokenizer the edge uses: ``--tokenizer``, the draft's, the
    local target's, else the embedded one; it must be the target's (fingerprints)."""
    from specdec.model.loading import tokenizer_fingerprint

    drafter, tok = load_drafter(a.draft, device=a.device, dtype=a.dtype, seed=a.draft_seed,
                                vocab_size=info.vocab_size)
    if a.tokenizer:
        tok = load_tokenizer(a.tokenizer)
    elif tok is None:
        tok = local_tok
    if tok is None and info.tokenizer_fingerprint != "none":
        tok = load_tokenizer("embedded")
    if tok is not None and info.tokenizer_fingerprint != "none" and tokenizer_fingerprint(tok) != \
            info.tokenizer_fingerprint:
        from specdec.errors import TokenizerMismatch

        raise TokenizerMismatch(
            f"the edge tokenizer (fingerprint {tokenizer_fingerprint(tok)}) is not the target's "
            f"({info.tokenizer_fingerprint}, model {info.model}); pass --tokenizer or a draft sharing it")
    return drafter, tok


def _agent_config(a, **kw) -> AgentConfig:
    return AgentConfig(mode=a.mode, depth_policy=a.depth_policy, depth=a.depth, max_depth=a.max_depth,
                       budget=a.budget, topk=a.topk, max_expand=a.max_expand, verify=a.verify,
                       predraft=a.predraft, guesses=a.guesses, run_ahead=a.run_ahead,
                       verify_state=_verify_state(a), **kw)


async def _generate(a) -> int:
    local_tok = None
    if a.local:
        transport, local_tok = _local_transport(a)
    else:
        transport = _transport(a)
    async with transport:
        info = await transport.model_info()
        drafter, tok = _draft_and_tokenizer(a, info, local_tok)
        if a.prompt is not None and tok is None:
            raise SystemExit("error: the target has no tokenizer; use --prompt-ids")
        prompt = _prompt(a, tok)
        cfg = _agent_config(a, model=a.model)
        agent = EdgeAgent(transport, drafter, tokenizer=tok, config=cfg)
        metrics = None
        if a.metrics_port is not None:
            from edge_agent.metrics import EdgeMetrics

            metrics = EdgeMetrics()
            port = metrics.serve(a.metrics_port)
            print(f"[edge-agent] metrics on http://127.0.0.1:{port}/metrics", file=sys.stderr)

        def out(piece: str) -> None:
            sys.stdout.write(piece)
            sys.stdout.flush()

        def out_ids(ids: list[int]) -> None:
            out(" ".join(str(i) for i in ids) + " ")

        try:
            res = await agent.generate(prompt, _sampling(a),
                                       on_text=None if a.json else out,
                                       on_tokens=None if (a.json or tok is not None) else out_ids)
        finally:
            agent.close()
        if metrics is not None:
            metrics.observe(res.stats)
            await clock.sleep(a.metrics_linger)
            metrics.close()
    if a.json:
        print(json.dumps({"text": res.text, "token_ids": res.token_ids, "prompt_tokens": len(res.prompt_ids),
                          "stats": res.stats.to_dict(), "draft": a.draft, "mode": a.mode, "verify": a.verify,
                          "depth_policy": a.depth_policy, "model": info.model}))
    else:
        sys.stdout.write("\n")
        print(res.stats.summary(), file=sys.stderr)
    return 0


async def _serve(a) -> int:
    """``edge-agent serve``: load the draft once, serve OpenAI's API on ``--host:--port`` until SIGTERM/Ctrl-C."""
    from edge_agent.metrics import EdgeMetrics
    from edge_agent.server import AgentPool, EdgeServer, serve
    from edge_agent.transport import HttpTransport, RetryPolicy

    if not a.server:
        raise SystemExit("error: give --server URL (the cloud's router)")
    # a local client gets the cloud's 429 and connection failures at once, never a wait of ours
    transport = HttpTransport(a.server, api_key=a.api_key, ws=a.ws, timeout_s=a.timeout,
                              retry=RetryPolicy(attempts=2, max_retry_after_s=0.0))
    info = await transport.model_info()
    drafter, tok = _draft_and_tokenizer(a, info)
    pool = AgentPool(transport, drafter, tok, _agent_config(a, max_overload_waits=0), a.max_concurrency)
    server = EdgeServer(pool, info, EdgeMetrics(), a.server)

    def announce(host: str, port: int) -> None:
        print(f"[edge-agent] serving {info.model} (OpenAI API) on http://{host}:{port}/v1: draft "
              f"{getattr(drafter, 'name', a.draft)}, verified by {a.server}, mode {a.mode}, verify {a.verify}; "
              f"/health and /metrics on the same port", file=sys.stderr, flush=True)

    await serve(server.app, a.host, a.port, announce)
    print("[edge-agent] stopped", file=sys.stderr, flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    from edge_agent.errors import ConnectionLost, EdgeError, ServerUnreachable
    from specdec.errors import Forbidden, Overloaded, SpecError, TokenizerMismatch, Unauthorized

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    a = build_parser().parse_args(argv)
    try:
        command = {"info": _info, "generate": _generate, "serve": _serve}[a.command]
        return asyncio.run(command(a))
    except ServerUnreachable as e:
        print(f"error: cannot reach the server at {a.server}: is it running and is the URL right? ({e})",
              file=sys.stderr)
    except Unauthorized:
        print("error: the server rejected the API key (401 unauthorized): pass --api-key or set SPECEDGE_API_KEY",
              file=sys.stderr)
    except Forbidden as e:
        print(f"error: forbidden (403): {e.message}", file=sys.stderr)
    except TokenizerMismatch as e:  # the edge's own check, or the server's 400
        print(f"error: tokenizer mismatch: {e.message}", file=sys.stderr)
    except Overloaded as e:
        print(f"error: the server is overloaded (429), retry after {e.retry_after:.0f} s", file=sys.stderr)
    except SpecError as e:
        print(f"error: the server answered {e.status} {e.code}: {e.message}", file=sys.stderr)
    except (ConnectionLost, EdgeError) as e:
        print(f"error: {e}", file=sys.stderr)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    return 2


if __name__ == "__main__":
    sys.exit(main())
