#!/usr/bin/env bash
# Installs the Prometheus server and promtool from Debian's packages, only if missing
# (idempotent, root; the Debian service is never started: the tests run their own prometheus).
exec bash "$(dirname "$0")/../scripts/debian_install.sh" prometheus prometheus promtool
