#!/usr/bin/env bash
# Installs the Prometheus server and promtool from Debian's packages, only if missing.
# Idempotent; needs root (CI and the dev machines run as root). The Debian service is
# never started: the tests run their own prometheus process on a free port.
set -euo pipefail
if command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; then
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
# policy-rc.d 101 keeps the package's postinst from starting the prometheus service
had_policy=0
[ -e /usr/sbin/policy-rc.d ] && had_policy=1
if [ "$had_policy" = 0 ]; then
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d
    chmod +x /usr/sbin/policy-rc.d
fi
trap 'if [ "$had_policy" = 0 ]; then rm -f /usr/sbin/policy-rc.d; fi' EXIT
apt-get install -y -q --no-install-recommends prometheus
command -v prometheus >/dev/null && command -v promtool >/dev/null
