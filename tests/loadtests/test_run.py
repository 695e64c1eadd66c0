"""loadtests/run.py's process plumbing: the client's nice is given to a session of its own (Linux shares
the CPU between sessions, autogroups, before their processes)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from loadtests.run import autogroup_nice


def test_a_client_in_its_own_session_gets_the_nice_of_its_autogroup():
    if not Path("/proc/self/autogroup").exists():
        pytest.skip("no autogroups on this kernel")
    proc = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        theirs = Path(f"/proc/{proc.pid}/autogroup").read_text().split()
        if not theirs:  # its CPU group is a cgroup (a container): a nice given to the autogroup weighs nothing
            assert not autogroup_nice(proc.pid, 7)
            assert Path(f"/proc/{proc.pid}/autogroup").read_text().split() == []
            return
        mine = Path("/proc/self/autogroup").read_text().split()  # empty where this process sits in a cgroup
        if mine:
            assert theirs[0] != mine[0]  # a group of its own
        given = autogroup_nice(proc.pid, 7)  # a higher nice needs no privilege, but /proc may be read-only
        assert given == (Path(f"/proc/{proc.pid}/autogroup").read_text().split()[1:] == ["nice", "7"])
        if mine:  # the host's own autogroups (not a container): the nice is given
            assert given
    finally:
        proc.kill()
        proc.wait()
    assert not autogroup_nice(proc.pid, 7)  # gone: refused, not raised
