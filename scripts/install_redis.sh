#!/usr/bin/env bash
# Installs Debian's redis-server (7.0 on bookworm), only if missing (idempotent, root; the Debian service is
# never started): the GCS fault-tolerance tests and `make chaos` start their own redis-server on a free
# loopback port as the Ray head's external store (loadtests/cluster.py).
exec bash "$(dirname "$0")/debian_install.sh" redis-server redis-server
