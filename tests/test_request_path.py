"""Serve's request-path options as the environment Ray starts with (deploy/request_path.py)."""

import shutil

import pytest
from pydantic import ValidationError

from deploy.request_path import Ingress, RequestPathConfig


def test_defaults_are_the_adopted_path():
    rp = RequestPathConfig()
    assert rp.ingress is Ingress.direct and rp.throughput_optimized
    env = rp.env()
    assert env["RAY_SERVE_THROUGHPUT_OPTIMIZED"] == "1" and env["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "1"
    assert env["RAY_SERVE_ENABLE_HA_PROXY"] == "0"
    assert env["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"] == "30000"
    assert env["RAY_SERVE_METRICS_EXPORT_INTERVAL_MS"] == "1000"  # Serve's 100 ms costs idle CPU
    assert rp.client_port(8000) == 30000  # clients talk to the router's own port


def test_proxy_keeps_serves_default_and_turns_direct_ingress_off_explicitly():
    rp = RequestPathConfig(ingress="proxy", throughput_optimized=False)
    env = rp.env()
    # explicit "0": throughput-optimized Serve would otherwise switch direct ingress on by itself
    assert env["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "0" and env["RAY_SERVE_THROUGHPUT_OPTIMIZED"] == "0"
    assert rp.client_port(8123) == 8123


def test_port_ranges_do_not_overlap():
    env = RequestPathConfig(direct_port=41000).env()
    http = range(int(env["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"]), int(env["RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"]))
    grpc = range(int(env["RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT"]), int(env["RAY_SERVE_DIRECT_INGRESS_MAX_GRPC_PORT"]))
    assert not set(http) & set(grpc)


def test_a_stopping_ingress_replica_drains_only_where_a_balancer_is_in_front():
    # direct: clients connect to the replica itself; Ray's 30 s drain delayed every stop by 30 s
    assert RequestPathConfig().env()["RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"] == "0.0"
    behind_haproxy = RequestPathConfig.model_construct(**{**RequestPathConfig().model_dump(), "ingress": Ingress.haproxy})
    assert behind_haproxy.env()["RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"] == "30.0"  # Ray's own default
    assert "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S" not in RequestPathConfig(ingress="proxy").env()
    assert RequestPathConfig(drain_s=12).env()["RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"] == "12.0"
    with pytest.raises(ValidationError):
        RequestPathConfig(drain_s=-1)


def test_override_from_a_command_line():
    rp = RequestPathConfig().override(ingress="proxy")
    assert rp.ingress is Ingress.proxy and rp.throughput_optimized  # the other option kept
    assert RequestPathConfig().override() == RequestPathConfig()
    with pytest.raises(ValidationError):
        RequestPathConfig().override(ingress="nginx")


@pytest.mark.skipif(shutil.which("haproxy") is not None, reason="haproxy is installed here")
def test_haproxy_needs_the_binary():
    with pytest.raises(ValidationError, match="haproxy"):
        RequestPathConfig(ingress="haproxy")


def test_cli_prints_export_lines(capsys):
    from deploy.request_path import main

    assert main(["--ingress", "proxy", "--no-throughput-optimized"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "export RAY_SERVE_ENABLE_DIRECT_INGRESS=0" in lines and "export RAY_SERVE_THROUGHPUT_OPTIMIZED=0" in lines
