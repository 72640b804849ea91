"""Ray binding and authentication of `molt run` (issue 12 item 11, issue 13 item 7).

Ray 2.60's gRPC servers (GCS, raylet, workers) listen on every interface whatever
node_ip_address says, so what protects a local run is Ray's token authentication: the test
starts a cluster as `molt run` does and sees an unauthenticated call refused on those ports.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from molt_core.runtime.raycluster import ClusterAuthError, prepare_auth


def test_local_cluster_gets_a_fresh_token_unless_the_user_set_one(tmp_path):
    env = {}
    assert prepare_auth(None, env) == "token"
    assert env["RAY_AUTH_MODE"] == "token" and len(env["RAY_AUTH_TOKEN"]) == 64
    int(env["RAY_AUTH_TOKEN"], 16)  # 256 random bits, hex
    other = {}
    prepare_auth(None, other)
    assert other["RAY_AUTH_TOKEN"] != env["RAY_AUTH_TOKEN"]  # per run
    mine = {"RAY_AUTH_TOKEN": "mine"}
    prepare_auth(None, mine)
    assert mine == {"RAY_AUTH_TOKEN": "mine", "RAY_AUTH_MODE": "token"}
    (tmp_path / "tok").write_text("filetoken")
    by_file = {"RAY_AUTH_TOKEN_PATH": str(tmp_path / "tok")}
    prepare_auth(None, by_file)
    assert "RAY_AUTH_TOKEN" not in by_file and by_file["RAY_AUTH_MODE"] == "token"
    off = {"RAY_AUTH_MODE": "disabled"}
    assert prepare_auth(None, off) == "disabled" and off == {"RAY_AUTH_MODE": "disabled"}


def test_joining_a_cluster_needs_its_token_or_an_explicit_opt_out(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    with pytest.raises(ClusterAuthError, match="RAY_AUTH_TOKEN.*ray get-auth-token.*RAY_AUTH_MODE=disabled"):
        prepare_auth("10.0.0.5:6379", {"HOME": str(home)})
    with pytest.raises(ClusterAuthError):  # a token path that names no file is no token
        prepare_auth("10.0.0.5:6379", {"HOME": str(home), "RAY_AUTH_TOKEN_PATH": str(tmp_path / "missing")})
    env = {"HOME": str(home), "RAY_AUTH_TOKEN": "t"}
    assert prepare_auth("10.0.0.5:6379", env) == "token" and env["RAY_AUTH_MODE"] == "token"
    (home / ".ray").mkdir()
    (home / ".ray" / "auth_token").write_text("t")
    assert prepare_auth("10.0.0.5:6379", {"HOME": str(home)}) == "token"
    assert prepare_auth("10.0.0.5:6379", {"HOME": str(tmp_path), "RAY_AUTH_MODE": "disabled"}) == "disabled"


PROBE = textwrap.dedent('''
    import json, os, sys, time
    import psutil, grpc, ray
    from molt_core.config import RunConfig
    from molt_core.runtime.raycluster import init_ray

    init_ray(RunConfig.model_validate({"run": {"threads": 1}}), None)
    node = ray.nodes()[0]
    info = {"gcs_address": ray.get_runtime_context().gcs_address}
    token = os.environ["RAY_AUTH_TOKEN"]
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc, node_manager_pb2, node_manager_pb2_grpc

    def call(addr, stub_cls, method, req, md):
        stub = stub_cls(grpc.insecure_channel(addr))
        try:
            getattr(stub, method)(req, timeout=10, metadata=md)
            return "OK"
        except grpc.RpcError as e:
            return e.code().name

    raylet = f"{node['NodeManagerAddress']}:{node['NodeManagerPort']}"
    out = {}
    for md_name, md in [("none", None), ("wrong", [("authorization", "Bearer " + "0" * 64)]),
                        ("token", [("authorization", "Bearer " + token)])]:
        out["gcs_" + md_name] = call(info["gcs_address"], gcs_service_pb2_grpc.NodeInfoGcsServiceStub, "GetClusterId",
                                     gcs_service_pb2.GetClusterIdRequest(), md)
        out["raylet_" + md_name] = call(raylet, node_manager_pb2_grpc.NodeManagerServiceStub, "GetNodeStats",
                                        node_manager_pb2.GetNodeStatsRequest(), md)
    me = psutil.Process()
    listen = []
    for p in me.children(recursive=True):
        try:
            listen += [[p.name(), c.laddr.ip, c.laddr.port] for c in p.net_connections("inet") if c.status == "LISTEN"]
        except psutil.Error:
            pass
    out["listen"] = listen
    out["gcs_port"] = int(info["gcs_address"].rsplit(":", 1)[1])
    out["home_token"] = os.path.exists(os.path.expanduser("~/.ray/auth_token"))
    ray.shutdown()
    print("PROBE " + json.dumps(out))
''')


@pytest.mark.slow  # a Ray cluster start, ~25 s on 2 cores
@pytest.mark.parametrize("user_mode", [None, "disabled"])
def test_local_ray_cluster_refuses_unauthenticated_calls_and_prints_no_auth_warning(tmp_path, user_mode):
    """molt's default: every gRPC call without the run's token is refused by the GCS and the
    raylet. The user's explicit RAY_AUTH_MODE=disabled is the injected fault: the same probe
    then gets through, so the probe does tell an open cluster from a closed one."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    env.update(OMP_NUM_THREADS="1", RAY_USAGE_STATS_ENABLED="0", HOME=str(tmp_path))  # no ~/.ray token to fall back on
    if user_mode:
        env.update(RAY_AUTH_MODE=user_mode, RAY_AUTH_TOKEN="0" * 64)
    r = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(next(x for x in r.stdout.splitlines() if x.startswith("PROBE "))[6:])
    # the GCS listens on every interface (Ray 2.60 hard-codes it); the token is what guards it
    assert any(name == "gcs_server" and port == out["gcs_port"] for name, _, port in out["listen"])
    assert "Token authentication" not in r.stderr and "\x1b[" not in r.stderr
    if user_mode == "disabled":
        assert (out["gcs_none"], out["raylet_none"]) == ("OK", "OK")
        return
    assert (out["gcs_none"], out["gcs_wrong"], out["gcs_token"]) == ("UNAUTHENTICATED", "UNAUTHENTICATED", "OK")
    assert (out["raylet_none"], out["raylet_wrong"], out["raylet_token"]) == ("UNAUTHENTICATED", "UNAUTHENTICATED", "OK")
    assert not out["home_token"]  # the per-run token lives in the environment only, never in ~/.ray


def test_a_gpu_request_the_local_cluster_cannot_place_fails_fast(monkeypatch, capsys):
    """Ray would wait forever for GPUs a local cluster never gets (it only logs an autoscaler
    line every ~35 s): `molt run` stops at once with the sum it needed and the options to change;
    on a joined cluster (which may scale up) it warns and waits."""
    import types

    from molt_core.config import RunConfig
    from molt_core.runtime import raycluster

    cfg = RunConfig.model_validate({"trainer": {"num_gpus": 1, "world_size": 2}, "engine": {"num_gpus": 0.5, "num_engines": 2}})
    assert raycluster.gpu_shortfall(cfg, 3.0) is None
    msg = raycluster.gpu_shortfall(cfg, 1.0)
    assert msg.startswith("the run needs 3 GPU(s) (trainer.num_gpus 1 x trainer.world_size 2 + engine.num_gpus 0.5 x "
                          "engine.num_engines 2) but the Ray cluster has 1;")
    calls = []
    fake = types.SimpleNamespace(__version__="2.60.0", is_initialized=lambda: False, init=lambda **kw: calls.append("init"),
                                 cluster_resources=lambda: {"CPU": 2.0, "GPU": 1.0},
                                 shutdown=lambda: calls.append("shutdown"))
    monkeypatch.setitem(sys.modules, "ray", fake)
    monkeypatch.setattr(raycluster, "prepare_auth", lambda addr: "")
    monkeypatch.setattr(raycluster, "_refresh_ray_config", lambda: None)
    with pytest.raises(ValueError, match="needs 3 GPU"):
        raycluster.init_ray(cfg, None)
    assert calls == ["init", "shutdown"]
    calls.clear()
    assert raycluster.init_ray(cfg, "10.0.0.1:6379") is fake and calls == ["init"]
    assert "warning: the run needs 3 GPU(s)" in capsys.readouterr().err
    cpu = RunConfig.model_validate({})
    assert raycluster.gpu_shortfall(cpu, 0.0) is None


@pytest.fixture
def ray_env(monkeypatch):
    """The variables init_ray sets by default, restored after the test."""
    for k, v in {"RAY_USAGE_STATS_ENABLED": "0", "RAY_DEDUP_LOGS": "1", "RAY_COLOR_PREFIX": "0"}.items():
        monkeypatch.setenv(k, os.environ.get(k, v))


@pytest.mark.parametrize("version", ["2.40.0", "2.51.1", "1.13.0"])
def test_a_ray_without_token_authentication_is_refused_before_any_cluster(monkeypatch, ray_env, version):
    """Ray before 2.52 has no token authentication: its cluster would take any connection, so
    init_ray stops before ray.init with the fix."""
    import ray

    from molt_core.config import RunConfig
    from molt_core.runtime import raycluster

    calls = []
    monkeypatch.setattr(ray, "__version__", version)
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append("init"))
    monkeypatch.setattr(ray, "is_initialized", lambda: calls.append("is_initialized") or False)
    monkeypatch.setattr(raycluster, "prepare_auth", lambda addr: "token")  # leave os.environ alone
    with pytest.raises(ClusterAuthError) as e:
        raycluster.init_ray(RunConfig.model_validate({}), None)
    assert str(e.value) == (f"Ray {version} has no token authentication (it arrived in Ray 2.52), so the cluster's "
                            f"ports would be open to any connection; pip install 'ray>=2.52'")
    assert calls == []


@pytest.mark.parametrize("version", ["2.52.0", "2.52.0rc1", "2.60.0", "2.100.1", "3.0.0.dev0"])
def test_a_ray_with_token_authentication_passes_the_check(monkeypatch, ray_env, version):
    import ray

    from molt_core.config import RunConfig
    from molt_core.runtime import raycluster

    monkeypatch.setattr(ray, "__version__", version)
    monkeypatch.setattr(ray, "is_initialized", lambda: True)  # returns right after the check: no cluster
    monkeypatch.setattr(raycluster, "prepare_auth", lambda addr: "token")
    assert raycluster.init_ray(RunConfig.model_validate({}), None) is ray


def test_the_installed_ray_has_token_authentication(monkeypatch, ray_env):
    """The Ray this environment has passes the check (pyproject: ray>=2.52) and has the
    token loader init_ray refreshes."""
    import ray
    from ray._raylet import AuthenticationTokenLoader  # noqa: F401  (Ray's token authentication)

    from molt_core.config import RunConfig
    from molt_core.runtime import raycluster

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(raycluster, "prepare_auth", lambda addr: "token")
    assert raycluster.init_ray(RunConfig.model_validate({}), None) is ray
