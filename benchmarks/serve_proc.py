"""The server side of a benchmark: the Serve app in its own process, on its own core.

Started by :mod:`benchmarks.run` as ``taskset -c 0 python -m benchmarks.serve_proc
--config cfg.json --port P [--request-path JSON]``. A local Ray with one CPU
(``ray.init(address="local", num_cpus=1)``; every Ray process it spawns inherits the core-0
affinity), Serve's HTTP proxy on 127.0.0.1:P, ``deploy.application.build_app(cfg)`` deployed,
then it blocks until SIGTERM/SIGINT and shuts Serve and Ray down. Prints ``READY`` once the
app is up. ``--request-path`` (:class:`deploy.request_path.RequestPathConfig`) goes into the
environment before Ray starts, so every Ray process runs with it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import traceback


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--config", required=True, help="AppConfig as a JSON file")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--request-path", default="{}", help="RequestPathConfig as JSON (deploy/request_path.py)")
    args = ap.parse_args(argv)
    cfg = json.loads(open(args.config).read())
    from deploy.request_path import RequestPathConfig

    os.environ.update(RequestPathConfig(**json.loads(args.request_path)).env())  # before Ray starts

    import ray
    from ray import serve

    from deploy.application import build_app

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False, configure_logging=False,
             _node_ip_address="127.0.0.1")
    failed = False
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": args.port})
        serve.run(build_app(cfg), name="specedge", route_prefix="/")
        print(f"READY affinity={sorted(os.sched_getaffinity(0))}", flush=True)
        stop.wait()
    except Exception:  # the reason first, in the log: shutting Ray down takes seconds and may be cut short
        traceback.print_exc()
        sys.stderr.flush()
        failed = True
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
