"""`make demo`: serve `deploy.app` on a local Ray, run an edge agent against it, print figures.

1. ``serve run deploy.app`` in the background (its own process group; local Ray, the
   embedded SmolLM2-135M-Instruct target, port 8000), on the request path the project
   adopts (:mod:`deploy.request_path`: throughput-optimized Serve, and the router serving
   its own port, 30000, which the agent uses);
2. ``edge-agent generate`` with the project's trained draft streams the answer to a chat
   prompt as the server verifies it, and prints its summary line;
3. the same prompt once more through the server-only path (``/v1/chat/completions``,
   plain autoregressive decoding on the server) for comparison;
4. stops the server it started (by process group id), whatever happened.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from deploy.request_path import RequestPathConfig

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
KEY = "specedge-dev-key"
PROMPT = "Explain in three sentences why the sky is blue."


def _wait_ready(url: str, proc: subprocess.Popen, log: Path, timeout: float = 600) -> dict:
    """Wait until the router answers and the verifier behind it has loaded the target."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            sys.exit(f"serve run exited early (code {proc.returncode}); last log lines:\n"
                     + log.read_text()[-3000:])
        try:
            r = httpx.get(f"{url}/v1/model", timeout=30)
            if r.status_code == 200:
                return r.json()
        except httpx.HTTPError:
            pass
        time.sleep(1)
    sys.exit(f"the server did not become ready in {timeout:.0f} s; see {log}")


def _draft_choice() -> str:
    try:
        from edge_agent.embedded_draft import artifact_available

        return "embedded-draft" if artifact_available() else "ngram"
    except ImportError:
        return "ngram"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt", default=PROMPT)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--port", type=int, default=8000, help="serve run's HTTP port (Serve's default)")
    args = ap.parse_args(argv)
    path = RequestPathConfig()
    url = f"http://127.0.0.1:{path.client_port(args.port)}"
    for port in {args.port, path.client_port(args.port)}:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                sys.exit(f"port {port} is already in use; stop what runs there (or pass --port with a free one "
                         "and a deploy config that uses it)")
    log = REPO / ".cache" / "demo-serve.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    # Ray starts its workers (proxy, router, verifier) at nice 15; here the edge agent shares the machine at 0
    # and would take the server's CPU whenever it drafts: the server's workers run at 0, as in benchmarks/
    env = dict(os.environ, HF_HUB_OFFLINE="1", RAY_USAGE_STATS_ENABLED="0", RAY_worker_niceness="0",
               PYTHONPATH=str(REPO), **path.env())
    # a Ray of the demo's own unless RAY_ADDRESS names one: `serve run` would otherwise attach to whatever
    # /tmp/ray/ray_current_cluster names, even a cluster that is gone (its GCS waited for, minutes)
    env.setdefault("RAY_ADDRESS", "local")
    print(f"[demo] starting `serve run deploy.app` (log: {log}) ...", flush=True)
    t0 = time.time()
    with open(log, "w") as logf:
        proc = subprocess.Popen([str(BIN / "serve"), "run", "deploy.app"], cwd=REPO, env=env, stdout=logf,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        info = _wait_ready(url, proc, log)
        print(f"[demo] server ready after {time.time() - t0:.1f} s: {info}", flush=True)
        draft = _draft_choice()
        cmd = [str(BIN / "edge-agent"), "generate", "--server", url, "--api-key", KEY, "--chat",
               "--draft", draft, "--max-tokens", str(args.max_tokens), "--prompt", args.prompt]
        print(f"[demo] edge agent (draft: {draft}, proactive drafting, server-paced depth):\n$ "
              + " ".join(cmd[1:]), flush=True)
        edge = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True)
        print(edge.stdout, end="", flush=True)
        if edge.returncode != 0:
            return edge.returncode
        edge_text = edge.stdout.rsplit("\n", 2)[0].strip()  # the last line is the summary
        print("\n[demo] the same prompt, server-only autoregressive decoding (/v1/chat/completions):", flush=True)
        t1 = time.time()
        r = httpx.post(f"{url}/v1/chat/completions", timeout=600, headers={"Authorization": f"Bearer {KEY}"},
                       json={"messages": [{"role": "user", "content": args.prompt}], "temperature": 0,
                             "max_tokens": args.max_tokens})
        r.raise_for_status()
        d = r.json()
        dt = time.time() - t1
        print(d["choices"][0]["message"]["content"])
        n = d["usage"]["completion_tokens"]
        print(f"[server-only AR] {n} tokens in {dt:.2f} s = {n / dt:.1f} tok/s, "
              f"{d['specedge'].get('tokens_per_round', 1.0):.2f} tokens per verify round")
        server_text = d["choices"][0]["message"]["content"].strip()
        same = next((i for i, (a, b) in enumerate(zip(edge_text, server_text)) if a != b),
                    None if len(edge_text) == len(server_text) else min(len(edge_text), len(server_text)))
        if same is None:
            print("[demo] edge-drafted and server-only outputs are identical (bfloat16: batch-invariant verifier).")
        else:
            print(f"[demo] MISMATCH: the two outputs agree for {same} characters, then differ. The verifier's "
                  "output must not depend on trees or batches in any dtype (README, 'Guarantees'): please report "
                  "this as a bug.")
            return 1
        return 0
    finally:
        print("[demo] stopping the server ...", flush=True)
        try:
            os.killpg(proc.pid, signal.SIGINT)
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        except ProcessLookupError:
            pass


if __name__ == "__main__":
    sys.exit(main())
