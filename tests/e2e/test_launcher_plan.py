"""`radixserve up`'s plan: ports, rank environment and start order (no processes started)."""

from __future__ import annotations

from radixserve.launcher_config import config_from_args
from radixserve.stack_plan import plan_stack


def test_ports_ranks_and_order_follow_the_convention():
    args = config_from_args(["up", "--tp", "2", "--port", "6000", "--host", "0.0.0.0",
                                      "--model", "m", "--kv-cache-mb", "32", "--device", "cpu"])
    plan = plan_stack(args, python="py")
    workers, (router,), (gateway,) = plan.groups
    assert [w.name for w in workers] == ["worker0", "worker1"]
    assert [w.health_address for w in workers] == ["127.0.0.1:6009", "127.0.0.1:6010"]
    assert [w.env["RANK"] for w in workers] == ["0", "1"]
    assert {w.env["WORLD_SIZE"] for w in workers} == {"2"}
    assert len({w.env["MASTER_PORT"] for w in workers}) == 1
    assert workers[0].cmd[:3] == ["py", "-m", "worker_service"]
    assert "--kv-cache-mb" in workers[0].cmd and "32" in workers[0].cmd
    assert router.cmd[router.cmd.index("--port") + 1] == "6001"
    assert router.cmd[router.cmd.index("--workers") + 1] == "127.0.0.1:6009,127.0.0.1:6010"
    assert gateway.cmd[gateway.cmd.index("--host") + 1] == "0.0.0.0"
    assert gateway.cmd[gateway.cmd.index("--routers") + 1] == "127.0.0.1:6001"
    # The gateway listens on every address; it is checked (and shown) on loopback.
    assert plan.gateway_address == "127.0.0.1:6000"


def test_ranks_openmp_threads_sleep_unless_the_environment_says(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    workers = plan_stack(config_from_args(["up", "--tp", "2"]), python="py").groups[0]
    assert {w.env["OMP_WAIT_POLICY"] for w in workers} == {"passive"}
    monkeypatch.setenv("OMP_WAIT_POLICY", "active")  # the child inherits it as it is
    workers = plan_stack(config_from_args(["up", "--tp", "2"]), python="py").groups[0]
    assert all("OMP_WAIT_POLICY" not in w.env for w in workers)
    monkeypatch.delenv("OMP_WAIT_POLICY")
    monkeypatch.setenv("GOMP_SPINCOUNT", "20000")  # a spin count alone is kept too (passive would zero it)
    workers = plan_stack(config_from_args(["up", "--tp", "2"]), python="py").groups[0]
    assert all("OMP_WAIT_POLICY" not in w.env for w in workers)


def test_flags_come_from_the_environment_too(monkeypatch):
    monkeypatch.setenv("RADIXSERVE_TP", "3")
    args = config_from_args(["up"])
    assert args.tp == 3 and args.port == 50051


def test_security_flags_are_passed_down():
    args = config_from_args([
        "up", "--tls-cert", "s.pem", "--tls-key", "k.pem", "--tls-ca", "ca.pem", "--mtls",
        "--internal-token-file", "it", "--api-token-file", "at", "--api-tokens", "t" * 20,
    ])
    workers, (router,), (gateway,) = plan_stack(args, python="py").groups
    shared = ["--tls-cert", "s.pem", "--tls-key", "k.pem", "--tls-ca", "ca.pem",
              "--internal-token-file", "it", "--mtls"]
    for child in (*workers, router, gateway):
        assert child.cmd[-len(shared):] == shared or child.cmd[-len(shared) - 2:-2] == shared
    assert gateway.cmd[-2:] == ["--api-token-file", "at"]
    assert "--api-token-file" not in router.cmd + workers[0].cmd
    # API tokens travel in the gateway's environment, never on a command line.
    assert gateway.env["RADIXSERVE_API_TOKENS"] == "t" * 20
    assert all("t" * 20 not in " ".join(c.cmd) for c in (*workers, router, gateway))


def test_router_and_gateway_settings_go_to_the_services_that_declare_them():
    args = config_from_args([
        "up", "--served-model-name", "my-model", "--shutdown-grace-s", "7", "--no-overlap",
        "--default-max-tokens", "33", "--max-queue", "9",
    ])
    plan = plan_stack(args, python="py")
    _, (router,), (gateway,) = plan.groups
    assert router.cmd[-7:] == ["--max-queue", "9", "--no-overlap", "--shutdown-grace-s", "7.0",
                               "--served-model-name", "my-model"]
    assert gateway.cmd[-4:] == ["--shutdown-grace-s", "7.0", "--default-max-tokens", "33"]
    assert plan.model_id == "my-model"
    # What each service parses from them.
    from gateway_service.config import PROGRAM as GATEWAY
    from router_service.config import PROGRAM as ROUTER
    router_config = ROUTER.parse(router.cmd[3:], {})
    assert (router_config.served_model_name, router_config.shutdown_grace_s, router_config.overlap,
            router_config.max_queue) == ("my-model", 7.0, False, 9)
    gateway_config = GATEWAY.parse(gateway.cmd[3:], {})
    assert (gateway_config.shutdown_grace_s, gateway_config.default_max_tokens) == (7.0, 33)


def test_unset_router_and_gateway_settings_are_not_passed():
    _, (router,), (gateway,) = plan_stack(config_from_args(["up"]), python="py").groups
    assert "--shutdown-grace-s" not in router.cmd + gateway.cmd
    assert "--served-model-name" not in router.cmd


def test_quantization_is_passed_to_every_worker_rank():
    workers, _, _ = plan_stack(config_from_args(["up", "--tp", "2", "--quantization", "int4",
                                                 "--activation-quantization", "int8"]), python="py").groups
    for worker in workers:
        assert worker.cmd[worker.cmd.index("--quantization") + 1] == "int4"
        assert worker.cmd[worker.cmd.index("--activation-quantization") + 1] == "int8"
    default, _, _ = plan_stack(config_from_args(["up"]), python="py").groups
    assert default[0].cmd[default[0].cmd.index("--quantization") + 1] == "none"
    assert default[0].cmd[default[0].cmd.index("--activation-quantization") + 1] == "auto"


def test_gateways_share_the_public_ports_and_have_metrics_ports_of_their_own():
    args = config_from_args(["up", "--gateways", "3", "--port", "6000", "--http-port", "8000",
                             "--metrics-port", "7000", "--model", "m"])
    _, (router,), gateways = plan_stack(args, python="py").groups
    assert [g.name for g in gateways] == ["gateway", "gateway1", "gateway2"]
    for gateway in gateways:
        assert gateway.cmd[gateway.cmd.index("--port") + 1] == "6000"
        assert gateway.cmd[gateway.cmd.index("--http-port") + 1] == "8000"
        assert gateway.cmd[gateway.cmd.index("--routers") + 1] == "127.0.0.1:6001"
        assert gateway.health_address == "127.0.0.1:6000"
    # Gateway M, router M+1, the rank M+9, the other gateways after it: M+10, M+11.
    assert [g.cmd[g.cmd.index("--metrics-port") + 1] for g in gateways] == ["7000", "7010", "7011"]
    assert router.cmd[router.cmd.index("--metrics-port") + 1] == "7001"
    off = config_from_args(["up", "--gateways", "2", "--metrics-port", "0", "--model", "m"])
    assert {g.cmd[g.cmd.index("--metrics-port") + 1] for g in plan_stack(off, python="py").groups[2]} == {"0"}


def test_replicas_get_their_own_router_and_worker_group_and_the_gateway_knows_them_all():
    args = config_from_args(["up", "--replicas", "2", "--tp", "2", "--port", "6000", "--metrics-port", "7000",
                             "--model", "m"])
    workers, routers, (gateway,) = plan_stack(args, python="py").groups
    assert [w.name for w in workers] == ["worker0", "worker1", "worker0_1", "worker1_1"]
    assert [w.health_address for w in workers] == [f"127.0.0.1:{p}" for p in (6009, 6010, 6011, 6012)]
    assert [r.name for r in routers] == ["router", "router_1"]
    assert [r.cmd[r.cmd.index("--workers") + 1] for r in routers] == [
        "127.0.0.1:6009,127.0.0.1:6010", "127.0.0.1:6011,127.0.0.1:6012"]
    assert [r.cmd[r.cmd.index("--metrics-port") + 1] for r in routers] == ["7001", "7002"]
    assert [w.cmd[w.cmd.index("--metrics-port") + 1] for w in workers] == ["7009", "7010", "7011", "7012"]
    # Each group rendezvouses on its own port; ranks of one group share theirs.
    assert workers[0].env["MASTER_PORT"] == workers[1].env["MASTER_PORT"]
    assert workers[2].env["MASTER_PORT"] == workers[3].env["MASTER_PORT"]
    assert workers[0].env["MASTER_PORT"] != workers[2].env["MASTER_PORT"]
    assert gateway.cmd[gateway.cmd.index("--routers") + 1] == "127.0.0.1:6001,127.0.0.1:6002"


def test_replicas_and_gateways_together_keep_every_port_apart():
    args = config_from_args(["up", "--replicas", "3", "--gateways", "2", "--tp", "2", "--port", "6000",
                             "--metrics-port", "7000", "--model", "m"])
    workers, routers, gateways = plan_stack(args, python="py").groups
    metrics = [c.cmd[c.cmd.index("--metrics-port") + 1] for c in (*workers, *routers, *gateways)]
    assert len(set(metrics)) == len(metrics) == 6 + 3 + 2
    listening = [c.health_address for c in (*workers, *routers)] + [gateways[0].health_address]
    assert len(set(listening)) == len(listening)
    assert {g.cmd[g.cmd.index("--routers") + 1] for g in gateways} == {",".join(r.health_address for r in routers)}


def test_deterministic_is_passed_to_every_worker_rank():
    workers = plan_stack(config_from_args(["up", "--tp", "2", "--deterministic"]), python="py").groups[0]
    assert all("--deterministic" in worker.cmd for worker in workers)
    workers = plan_stack(config_from_args(["up"]), python="py").groups[0]
    assert all("--no-deterministic" in worker.cmd for worker in workers)
