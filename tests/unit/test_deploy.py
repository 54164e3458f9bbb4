"""Static checks of the deployment and alerting files (Dockerfile, deploy/).

They keep the files consistent with each other and with the code: the metrics
port, the console script, the shutdown timeout, the documented metric names.
Nothing here needs a container engine or a cluster; the checks that run external
validators (promtool, docker compose, kubectl kustomize) skip when the tool is absent.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry

from outbox_relay.config import MetricsSettings, RelaySettings

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DOCKERFILE = ROOT / "Dockerfile"
COMPOSE_FILE = DEPLOY / "docker-compose.yml"
ALERTS_FILE = DEPLOY / "prometheus" / "alerts.yml"
PROMETHEUS_FILE = DEPLOY / "prometheus" / "prometheus.yml"
DASHBOARD_FILE = DEPLOY / "grafana" / "dashboards" / "outbox-relay.json"
K8S = DEPLOY / "kubernetes"

METRICS_PORT = MetricsSettings().port
SHUTDOWN_TIMEOUT = RelaySettings().shutdown_timeout_seconds

_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}


def exported_metrics() -> set[str]:
    """Every series the relay exports, as PromQL sees them (counters with _total,
    histograms as _bucket/_count/_sum), read from the relay's own metric registry:
    the one list of metrics (docs/reference/metrics.md is generated from it too)."""
    from outbox_relay.observability.metrics import RelayMetrics

    registry = CollectorRegistry()
    RelayMetrics(registry=registry)
    return {family.name + suffix for family in registry.collect() for suffix in _SUFFIXES.get(family.type, ("",))}


METRIC_TOKEN = re.compile(r"\boutbox_relay_[A-Za-z0-9_]+")


# --------------------------------------------------------------------------- helpers
def deploy_files(*suffixes: str) -> list[Path]:
    return sorted(p for p in DEPLOY.rglob("*") if p.is_file() and p.suffix in suffixes)


def load_yaml_docs(path: Path) -> list[Any]:
    with path.open(encoding="utf-8") as fh:
        return [doc for doc in yaml.safe_load_all(fh) if doc is not None]


def load_yaml(path: Path) -> Any:
    docs = load_yaml_docs(path)
    assert len(docs) == 1, f"{path} should hold exactly one YAML document"
    return docs[0]


def compose() -> dict[str, Any]:
    return load_yaml(COMPOSE_FILE)


def k8s(name: str) -> dict[str, Any]:
    return load_yaml(K8S / name)


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for raw in DOCKERFILE.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        keyword, _, args = line.partition(" ")
        instructions.append((keyword.upper(), args.strip()))
    assert not pending, "Dockerfile ends with a line continuation"
    return instructions


def exec_form(args: str) -> list[str]:
    value = json.loads(args)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), args
    return value


def final_stage() -> list[tuple[str, str]]:
    instructions = dockerfile_instructions()
    last_from = max(i for i, (kw, _) in enumerate(instructions) if kw == "FROM")
    return instructions[last_from:]


def duration_seconds(text: str | int | float) -> float:
    """Compose durations such as '30s', '1m30s' (or plain seconds)."""
    if isinstance(text, (int, float)):
        return float(text)
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", text)
    assert parts and "".join(n + u for n, u in parts) == text, f"bad duration {text!r}"
    return sum(float(n) * units[u] for n, u in parts)


def alert_rules() -> list[dict[str, Any]]:
    doc = load_yaml(ALERTS_FILE)
    return [rule for group in doc["groups"] for rule in group["rules"]]


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD_FILE.read_text(encoding="utf-8"))


def dashboard_queries() -> list[str]:
    """Every PromQL string of the dashboard: panel targets and template variable queries."""
    return _queries(dashboard())


def _queries(node: Any) -> list[str]:
    found: list[str] = []
    if isinstance(node, dict):
        for key, value in node.items():
            if isinstance(value, str) and (
                key in ("expr", "definition") or (key == "query" and node.get("type") != "datasource")
            ):
                found.append(value)
            else:
                found.extend(_queries(value))
    elif isinstance(node, list):
        for item in node:
            found.extend(_queries(item))
    return found


def dashboard_targets() -> list[str]:
    return [target["expr"] for panel in dashboard()["panels"] for target in panel.get("targets", [])]


def promtool() -> str:
    path = os.environ.get("PROMTOOL") or shutil.which("promtool")
    if not path:
        pytest.skip("promtool not on PATH (Debian package 'prometheus' provides it; or set PROMTOOL)")
    return path


def run(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, **kwargs)


# --------------------------------------------------------------------------- parsing
@pytest.mark.parametrize("path", deploy_files(".yml", ".yaml"), ids=lambda p: str(p.relative_to(ROOT)))
def test_yaml_files_parse(path: Path) -> None:
    docs = load_yaml_docs(path)
    assert docs, f"{path} is empty"
    for doc in docs:
        assert isinstance(doc, dict), f"{path}: every document should be a mapping"


@pytest.mark.parametrize("path", deploy_files(".json"), ids=lambda p: str(p.relative_to(ROOT)))
def test_json_files_parse(path: Path) -> None:
    assert isinstance(json.loads(path.read_text(encoding="utf-8")), dict)


def test_expected_files_exist() -> None:
    for path in (
        DOCKERFILE,
        ROOT / ".dockerignore",
        COMPOSE_FILE,
        ALERTS_FILE,
        PROMETHEUS_FILE,
        DASHBOARD_FILE,
        DEPLOY / "example-writer" / "writer.py",
        K8S / "kustomization.yaml",
    ):
        assert path.is_file(), f"missing {path.relative_to(ROOT)}"


def test_example_writer_compiles_and_uses_enqueue() -> None:
    source = (DEPLOY / "example-writer" / "writer.py").read_text(encoding="utf-8")
    compile(source, "writer.py", "exec")
    assert "from outbox_relay import enqueue" in source


# --------------------------------------------------------------------------- Dockerfile
def test_dockerfile_entrypoint_is_the_console_script() -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["scripts"]
    entrypoints = [exec_form(args) for kw, args in final_stage() if kw == "ENTRYPOINT"]
    assert entrypoints, "final stage has no exec-form ENTRYPOINT"
    argv = entrypoints[-1]
    if argv[0].endswith("tini"):  # tolerated wrapper: tini [--] <script>
        argv = argv[2:] if argv[1:2] == ["--"] else argv[1:]
    assert argv[0] in scripts, f"ENTRYPOINT {argv[0]!r} is not a console script of pyproject.toml: {sorted(scripts)}"
    cmds = [exec_form(args) for kw, args in final_stage() if kw == "CMD"]
    assert cmds and cmds[-1] == ["run"]


def test_dockerfile_exposes_and_probes_the_metrics_port() -> None:
    stage = final_stage()
    exposed = {port.split("/")[0] for kw, args in stage if kw == "EXPOSE" for port in args.split()}
    assert exposed == {str(METRICS_PORT)}
    healthchecks = [args for kw, args in stage if kw == "HEALTHCHECK"]
    assert len(healthchecks) == 1
    check = healthchecks[0]
    assert "urllib" in check and "/healthz" in check
    assert f"127.0.0.1:{METRICS_PORT}/healthz" in check or (
        "127.0.0.1:%s/healthz" in check and f"'{METRICS_PORT}'" in check
    ), check


def test_dockerfile_is_multi_stage_non_root_and_runtime_only() -> None:
    instructions = dockerfile_instructions()
    froms = [args for kw, args in instructions if kw == "FROM"]
    assert len(froms) >= 2, "expected a builder stage and a runtime stage"
    args = dict(a.split("=", 1) for kw, a in instructions if kw == "ARG" and "=" in a)
    final_base = re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), m.group(0)), froms[-1].split()[0])
    assert final_base == "python:3.11-slim"
    runs = " ".join(a for kw, a in instructions if kw == "RUN")
    assert "pip wheel --no-deps" in runs
    final_runs = " ".join(a for kw, a in final_stage() if kw == "RUN")
    assert "[test]" not in final_runs and "[embedded]" not in final_runs
    assert not re.search(r"\b(gcc|build-essential|g\+\+|make)\b", final_runs), "compilers in the runtime stage"
    users = [a for kw, a in final_stage() if kw == "USER"]
    assert users, "runtime stage runs as root"
    assert users[-1].split(":")[0] not in ("root", "0")


def test_dockerignore_keeps_the_build_inputs() -> None:
    ignored = {
        line.strip().rstrip("/")
        for line in (ROOT / ".dockerignore").read_text(encoding="utf-8").splitlines()
        if line.strip() and not line.startswith("#")
    }
    for needed in ("pyproject.toml", "README.md", "outbox_relay"):
        assert needed not in ignored
    for dropped in (".git", ".venv", "tests"):
        assert dropped in ignored


# --------------------------------------------------------------------------- compose
def test_compose_referenced_files_exist() -> None:
    doc = compose()
    for name, service in doc["services"].items():
        for volume in service.get("volumes", []):
            if isinstance(volume, dict):
                source = volume.get("source", "") if volume.get("type") == "bind" else ""
            else:
                source = volume.split(":", 1)[0]
            if source.startswith((".", "/")):
                assert (COMPOSE_FILE.parent / source).exists(), f"service {name}: {source} does not exist"
        build = service.get("build")
        if build:
            context = COMPOSE_FILE.parent / (build if isinstance(build, str) else build.get("context", "."))
            dockerfile = "Dockerfile" if isinstance(build, str) else build.get("dockerfile", "Dockerfile")
            assert (context / dockerfile).is_file(), f"service {name}: no {dockerfile} in {context}"


def _mounts(service: dict[str, Any]) -> dict[str, Path]:
    """container path -> host path of a service's bind mounts."""
    mounts = {}
    for volume in service.get("volumes", []):
        parts = volume.split(":")
        if parts[0].startswith("."):
            mounts[parts[1]] = (COMPOSE_FILE.parent / parts[0]).resolve()
    return mounts


def test_compose_prometheus_loads_the_rules_and_scrapes_the_relays() -> None:
    doc = compose()
    services = doc["services"]
    mounts = _mounts(services["prometheus"])
    config_arg = next(
        (a.split("=", 1)[1] for a in services["prometheus"].get("command", []) if a.startswith("--config.file=")),
        "/etc/prometheus/prometheus.yml",
    )
    assert mounts[config_arg] == PROMETHEUS_FILE.resolve()
    prom = load_yaml(PROMETHEUS_FILE)
    assert [mounts.get(f) for f in prom["rule_files"]] == [ALERTS_FILE.resolve()]

    relay = services["relay"]
    assert relay["deploy"]["replicas"] == 2
    assert str(METRICS_PORT) in [str(p) for p in relay.get("expose", [])]
    env = relay.get("environment", {})
    assert str(env.get("OUTBOX_RELAY_METRICS__PORT", METRICS_PORT)) == str(METRICS_PORT)
    assert duration_seconds(relay["stop_grace_period"]) > SHUTDOWN_TIMEOUT

    sd = [c for job in prom["scrape_configs"] for c in job.get("dns_sd_configs", [])]
    assert sd, "no dns_sd_configs"
    assert any("relay" in c["names"] and c["port"] == METRICS_PORT for c in sd)
    jobs = [job["job_name"] for job in prom["scrape_configs"] if job.get("dns_sd_configs")]
    assert jobs == ["outbox-relay"], 'alerts.yml selects job="outbox-relay"'


def test_compose_services_and_ordering() -> None:
    services = compose()["services"]
    assert services["postgres"]["image"].startswith("postgres:18")
    assert services["kafka"]["image"].startswith("apache/kafka:")
    assert services["kafka"]["environment"]["KAFKA_PROCESS_ROLES"] == "broker,controller"
    assert services["migrate"]["command"] == ["migrate"]
    assert services["relay"]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    assert services["relay"]["command"] == ["run"]
    # Least privilege: the owner migrates and grants; relay and writer use their own roles.
    assert services["relay"]["depends_on"]["apply-grants"]["condition"] == "service_completed_successfully"
    assert "outbox-relay grants --relay outbox_relay" in services["grants"]["command"][0]
    dsn = "OUTBOX_RELAY_DATABASE__DSN"
    assert services["migrate"]["environment"][dsn].startswith("postgresql://outbox:")
    assert services["relay"]["environment"][dsn].startswith("postgresql://outbox_relay:")
    assert services["writer"]["environment"]["WRITER_DSN"].startswith("postgresql://outbox_writer:")


def test_compose_grafana_provisions_the_dashboard() -> None:
    services = compose()["services"]
    mounts = _mounts(services["grafana"])
    provisioning = mounts["/etc/grafana/provisioning"]
    providers = [p for f in sorted((provisioning / "dashboards").glob("*.y*ml")) for p in load_yaml(f)["providers"]]
    assert providers
    for provider in providers:
        host_dir = mounts[provider["options"]["path"]]
        assert (host_dir / DASHBOARD_FILE.name).resolve() == DASHBOARD_FILE.resolve()
    datasources = [
        d for f in sorted((provisioning / "datasources").glob("*.y*ml")) for d in load_yaml(f)["datasources"]
    ]
    assert any(d["type"] == "prometheus" for d in datasources)


def test_docker_compose_config() -> None:
    docker = shutil.which("docker")
    if not docker or run([docker, "compose", "version"]).returncode != 0:
        pytest.skip("the docker compose plugin is not installed")
    result = run([docker, "compose", "-f", str(COMPOSE_FILE), "config", "--quiet"])
    assert result.returncode == 0, result.stderr


# --------------------------------------------------------------------------- metric names
def test_alert_expressions_use_exported_metrics_only() -> None:
    exported = exported_metrics()
    for rule in alert_rules():
        texts = [rule["expr"], *rule.get("annotations", {}).values()]
        names = {m for text in texts for m in METRIC_TOKEN.findall(text)}
        assert names <= exported, f"{rule['alert']}: not exported {sorted(names - exported)}"


def test_dashboard_expressions_use_exported_metrics_only() -> None:
    queries = dashboard_queries()
    assert queries
    exported = exported_metrics()
    used = {m for q in queries for m in METRIC_TOKEN.findall(q)}
    assert used <= exported, sorted(used - exported)


# --------------------------------------------------------------------------- alerts
def test_alerts_have_runbook_annotations_and_severity() -> None:
    rules = alert_rules()
    assert len({r["alert"] for r in rules}) == len(rules), "duplicate alert names"
    for rule in rules:
        annotations = rule.get("annotations", {})
        assert annotations.get("summary", "").strip(), f"{rule['alert']}: no summary"
        assert "runbook" in annotations.get("description", "").lower(), f"{rule['alert']}: no runbook line"
        assert rule.get("labels", {}).get("severity") in {"warning", "critical"}


def test_alerts_cover_the_seed_monitoring_section() -> None:
    """A backlog that ages, new dead rows, lost or expiring leases, plus breaker and liveness."""
    rules = alert_rules()

    def matching(pattern: str) -> list[dict[str, Any]]:
        found = [r for r in rules if re.search(pattern, r["expr"])]
        assert found, f"no alert on {pattern}"
        return found

    (age,) = matching(r"outbox_relay_oldest_pending_age_seconds")
    assert re.search(r">\s*300\b", age["expr"]), "oldest pending age SLO is 5 minutes"
    matching(r'outbox_relay_queue_depth\{status="dead"\}')
    matching(r"outbox_relay_expired_leases")
    (lost,) = matching(r"outbox_relay_lost_leases_total")
    assert "rate(" in lost["expr"] and re.search(r">\s*0\b", lost["expr"])
    (breaker,) = matching(r"outbox_relay_circuit_breaker_open")
    assert duration_seconds(breaker["for"]) == 120
    matching(r'\bup\{job="outbox-relay"\}\s*==\s*0')
    matching(r"\babsent\(")


# --------------------------------------------------------------------------- dashboard
def test_dashboard_covers_the_relay_metrics() -> None:
    exprs = dashboard_targets()
    used = {m for e in exprs for m in METRIC_TOKEN.findall(e)}
    for name in (
        "outbox_relay_oldest_pending_age_seconds",
        "outbox_relay_queue_depth",
        "outbox_relay_published_total",
        "outbox_relay_lost_leases_total",
        "outbox_relay_expired_leases",
        "outbox_relay_publish_latency_seconds_bucket",
        "outbox_relay_end_to_end_latency_seconds_bucket",
        "outbox_relay_claim_batch_size_bucket",
        "outbox_relay_attempts",
        "outbox_relay_circuit_breaker_open",
        "outbox_relay_blocked_aggregates",
        "outbox_relay_xmin_horizon_age_seconds",
        "outbox_relay_dead_tuples",
        "outbox_relay_table_size_bytes",
    ):
        assert name in used, f"dashboard has no panel on {name}"
    for hist in ("publish_latency_seconds", "end_to_end_latency_seconds"):
        for q in ("0.5", "0.99"):
            assert any(f"histogram_quantile({q}," in e and f"outbox_relay_{hist}_bucket" in e for e in exprs), (
                f"no p{q} of {hist}"
            )
    ids = [p["id"] for p in dashboard()["panels"]]
    assert len(ids) == len(set(ids)), "duplicate panel ids"


# --------------------------------------------------------------------------- kubernetes
def test_kustomization_lists_every_manifest_and_they_exist() -> None:
    resources = k8s("kustomization.yaml")["resources"]
    for resource in resources:
        assert (K8S / resource).is_file(), f"kustomization lists missing {resource}"
    manifests = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert manifests == set(resources)


def _relay_container() -> dict[str, Any]:
    containers = k8s("deployment.yaml")["spec"]["template"]["spec"]["containers"]
    (container,) = [c for c in containers if c["name"] == "relay"]
    return container


def test_k8s_deployment_probes_and_ports() -> None:
    deployment = k8s("deployment.yaml")
    assert deployment["spec"]["replicas"] == 3
    container = _relay_container()
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"metrics": METRICS_PORT}
    for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
        get = container[probe]["httpGet"]
        assert get["path"] == path
        assert get["port"] in ("metrics", METRICS_PORT)
    assert container["resources"]["requests"] and container["resources"]["limits"]
    refs = {next(iter(ref)) for ref in container["envFrom"]}
    assert refs == {"configMapRef", "secretRef"}
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True


def test_k8s_grace_period_exceeds_the_shutdown_timeout() -> None:
    pod = k8s("deployment.yaml")["spec"]["template"]["spec"]
    grace = pod["terminationGracePeriodSeconds"]
    assert grace > SHUTDOWN_TIMEOUT
    configured = k8s("configmap.yaml")["data"].get("OUTBOX_RELAY_RELAY__SHUTDOWN_TIMEOUT_SECONDS")
    if configured is not None:
        assert grace > float(configured)


def _quantity_bytes(text: str) -> int:
    units = {"Ki": 1024, "Mi": 1024**2, "Gi": 1024**3}
    for suffix, factor in units.items():
        if str(text).endswith(suffix):
            return int(float(str(text)[: -len(suffix)]) * factor)
    return int(text)


def test_k8s_memory_limit_fits_the_in_flight_budget() -> None:
    """Memory is bounded by relay.max_in_flight_bytes: the shipped limit
    keeps the sizing rule of docs/explanation/memory.md, limit >= 100 MiB + 3 x max_in_flight_bytes."""
    from outbox_relay.config import RelaySettings

    container = k8s("deployment.yaml")["spec"]["template"]["spec"]["containers"][0]
    limit = _quantity_bytes(container["resources"]["limits"]["memory"])
    configured = k8s("configmap.yaml")["data"].get("OUTBOX_RELAY_RELAY__MAX_IN_FLIGHT_BYTES")
    budget = int(configured) if configured is not None else RelaySettings().max_in_flight_bytes
    assert limit >= 100 * 1024**2 + 3 * budget, (limit, budget)
    assert _quantity_bytes(container["resources"]["requests"]["memory"]) <= limit


def test_k8s_service_servicemonitor_and_config_use_the_metrics_port() -> None:
    service = k8s("service.yaml")
    (port,) = service["spec"]["ports"]
    assert port["name"] == "metrics" and port["port"] == METRICS_PORT
    assert port["targetPort"] in ("metrics", METRICS_PORT)
    assert service["metadata"]["name"] == "outbox-relay", "job label of the alerts"

    monitor = k8s("servicemonitor.yaml")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1" and monitor["kind"] == "ServiceMonitor"
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= service["metadata"]["labels"].items()
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == ["metrics"]

    data = k8s("configmap.yaml")["data"]
    assert data.get("OUTBOX_RELAY_METRICS__PORT", str(METRICS_PORT)) == str(METRICS_PORT)
    assert all(key.startswith("OUTBOX_RELAY_") for key in data)
    assert all(isinstance(v, str) for v in data.values()), "ConfigMap values must be strings"


def test_k8s_selectors_match_pod_labels() -> None:
    labels = k8s("deployment.yaml")["spec"]["template"]["metadata"]["labels"]
    for selector in (
        k8s("deployment.yaml")["spec"]["selector"]["matchLabels"],
        k8s("service.yaml")["spec"]["selector"],
        k8s("pdb.yaml")["spec"]["selector"]["matchLabels"],
    ):
        assert selector.items() <= labels.items()
    assert k8s("pdb.yaml")["spec"]["minAvailable"] == 1


def test_k8s_secret_and_migrate_job() -> None:
    secret = k8s("secret.yaml")
    assert set(secret["stringData"]) == {"OUTBOX_RELAY_DATABASE__DSN", "OUTBOX_RELAY_KAFKA__SASL_PASSWORD"}
    config_keys = set(k8s("configmap.yaml")["data"])
    assert not config_keys & set(secret["stringData"]), "secrets must not be in the ConfigMap"
    assert not any("PASSWORD" in k or k.endswith("__DSN") for k in config_keys)

    job = k8s("migrate-job.yaml")
    assert job["kind"] == "Job"
    pod = job["spec"]["template"]["spec"]
    migrate, print_grants = pod["initContainers"]
    argv = migrate.get("command", ["outbox-relay"]) + migrate.get("args", [])
    assert argv == ["outbox-relay", "migrate"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    # Least privilege: only the Job uses the owner's Secret; the relay runs as its own role.
    owner = k8s("owner-secret.yaml")
    assert set(owner["stringData"]) == {"OUTBOX_RELAY_DATABASE__DSN"}
    for container in (migrate, print_grants, *pod["containers"]):
        assert {"secretRef": {"name": owner["metadata"]["name"]}} in container["envFrom"]
    assert "outbox-relay grants --relay outbox_relay" in " ".join(print_grants["args"])
    deployment_secrets = {ref["secretRef"]["name"] for ref in _relay_container()["envFrom"] if "secretRef" in ref}
    assert deployment_secrets == {secret["metadata"]["name"]}
    assert "outbox_relay:" in secret["stringData"]["OUTBOX_RELAY_DATABASE__DSN"]


def test_kubectl_kustomize_renders() -> None:
    kubectl = shutil.which("kubectl")
    if not kubectl:
        pytest.skip("kubectl not on PATH")
    result = run([kubectl, "kustomize", str(K8S)])
    assert result.returncode == 0, result.stderr
    kinds = {doc["kind"] for doc in yaml.safe_load_all(result.stdout) if doc}
    assert kinds == {"ConfigMap", "Secret", "Job", "Deployment", "Service", "ServiceMonitor", "PodDisruptionBudget"}


# --------------------------------------------------------------------------- promtool
def test_promtool_check_rules() -> None:
    tool = promtool()
    result = run([tool, "check", "rules", str(ALERTS_FILE)])
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_check_config(tmp_path: Path) -> None:
    """prometheus.yml names the rules by their path in the container: point it at the repo copy."""
    tool = promtool()
    prom = load_yaml(PROMETHEUS_FILE)
    prom["rule_files"] = [str(ALERTS_FILE)]
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump(prom), encoding="utf-8")
    result = run([tool, "check", "config", "--syntax-only", str(config)])
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_parses_dashboard_queries(tmp_path: Path) -> None:
    """Each dashboard query, with Grafana's variables filled in, is valid PromQL."""
    tool = promtool()
    substitutions = {"$__rate_interval": "5m", "$__interval": "1m", "$job": ".+"}
    rules = []
    for i, query in enumerate(q for q in dashboard_queries() if not q.startswith("label_values(")):
        for var, value in substitutions.items():
            query = query.replace(var, value)
        assert "$" not in query, f"unhandled Grafana variable in {query!r}"
        rules.append({"record": f"dashboard:query_{i}", "expr": query})
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}), encoding="utf-8")
    result = run([tool, "check", "rules", str(path)])
    assert result.returncode == 0, result.stdout + result.stderr


# Alert behaviour, checked with `promtool test rules`. Each case is one independent
# promtool test: input series (1m steps) and, per evaluation time, the labels of the
# alerts expected to be firing ([] = none). Gauges describing the table come from two
# replicas reporting the same value, as in production.
_R = {"job": "outbox-relay"}


def _series(name: str, values: str, **labels: str) -> dict[str, str]:
    all_labels = {**_R, "instance": "a:9464", **labels}
    body = ",".join(f'{k}="{v}"' for k, v in sorted(all_labels.items()))
    return {"series": f"{name}{{{body}}}", "values": values}


def _both(name: str, values: str, **labels: str) -> list[dict[str, str]]:
    return [_series(name, values, **labels), _series(name, values, instance="b:9464", **labels)]


CRIT, WARN = {"severity": "critical"}, {"severity": "warning"}
ALERT_CASES: dict[str, tuple[list[dict[str, str]], list[tuple[str, str, list[dict[str, str]]]]]] = {
    "oldest pending age above 5 minutes": (
        _both("outbox_relay_oldest_pending_age_seconds", "0x4 400x10"),
        [("5m", "OutboxRelayOldestPendingAgeHigh", []), ("7m", "OutboxRelayOldestPendingAgeHigh", [CRIT])],
    ),
    "oldest pending age within the SLO": (
        _both("outbox_relay_oldest_pending_age_seconds", "0 30 290x20"),
        [("15m", "OutboxRelayOldestPendingAgeHigh", [])],
    ),
    "a new dead row": (
        _both("outbox_relay_queue_depth", "0x12 1x10", status="dead"),
        [("11m", "OutboxRelayNewDeadRows", []), ("15m", "OutboxRelayNewDeadRows", [WARN])],
    ),
    "dead rows retried by an operator": (
        [
            *_both("outbox_relay_queue_depth", "5x12 2x10", status="dead"),
            _series("outbox_relay_published_total", "0x22", outcome="dead"),
        ],
        [("15m", "OutboxRelayNewDeadRows", [])],
    ),
    "one row retried while another died": (
        [
            *_both("outbox_relay_queue_depth", "3x22", status="dead"),
            _series("outbox_relay_published_total", "0x12 1x10", outcome="dead"),
        ],
        [("15m", "OutboxRelayNewDeadRows", [WARN])],
    ),
    "a row reaped to dead": (
        [*_both("outbox_relay_queue_depth", "0x22", status="dead"), _series("outbox_relay_reaped_total", "0x12 1x10")],
        [("15m", "OutboxRelayNewDeadRows", [WARN])],
    ),
    "expired leases stuck": (
        _both("outbox_relay_expired_leases", "0x4 3x30"),
        [("15m", "OutboxRelayExpiredLeasesGrowing", []), ("25m", "OutboxRelayExpiredLeasesGrowing", [WARN])],
    ),
    "expired leases draining": (
        _both("outbox_relay_expired_leases", "30-1x30"),
        [("25m", "OutboxRelayExpiredLeasesGrowing", [])],
    ),
    "a lost lease": (
        [_series("outbox_relay_lost_leases_total", "0x5 1x10")],
        [("4m", "OutboxRelayLostLeases", []), ("8m", "OutboxRelayLostLeases", [WARN])],
    ),
    "circuit breaker open": (
        [
            _series("outbox_relay_circuit_breaker_open", "0x2 1x10"),
            _series("outbox_relay_circuit_breaker_open", "0x12", instance="b:9464"),
        ],
        [
            ("3m", "OutboxRelayCircuitBreakerOpen", []),
            ("6m", "OutboxRelayCircuitBreakerOpen", [{**CRIT, "instance": "a:9464"}]),
        ],
    ),
    "one partition unwritable for 6 minutes": (
        [
            _series("outbox_relay_unwritable_partitions", "0x2 1x10", cause="not_enough_replicas"),
            _series("outbox_relay_unwritable_partitions", "0x12", cause="leader_unreachable"),
        ],
        [
            ("5m", "OutboxRelayPartitionsUnwritable", []),
            (
                "9m",
                "OutboxRelayPartitionsUnwritable",
                [{**WARN, "instance": "a:9464", "cause": "not_enough_replicas"}],
            ),
        ],
    ),
    "a partition unwritable for 3 minutes, then healed": (
        [_series("outbox_relay_unwritable_partitions", "0 1 1 1 0x10", cause="leader_unreachable")],
        [("4m", "OutboxRelayPartitionsUnwritable", []), ("10m", "OutboxRelayPartitionsUnwritable", [])],
    ),
    "one replica down": (
        [_series("up", "1x2 0x10"), _series("up", "1x12", instance="b:9464")],
        [("6m", "OutboxRelayDown", [{**CRIT, **_R, "instance": "a:9464"}]), ("10m", "OutboxRelayAbsent", [])],
    ),
    "xmin horizon held back for 10 minutes": (
        _both("outbox_relay_xmin_horizon_age_seconds", "0 60+60x12"),
        [("5m", "OutboxRelayXminHorizonOld", []), ("11m", "OutboxRelayXminHorizonOld", [WARN])],
    ),
    "xmin horizon held for 4 minutes, then released": (
        _both("outbox_relay_xmin_horizon_age_seconds", "0 60 120 180 240 0x10"),
        [("4m", "OutboxRelayXminHorizonOld", []), ("12m", "OutboxRelayXminHorizonOld", [])],
    ),
    "xmin horizon not visible (NaN) never fires": (
        _both("outbox_relay_xmin_horizon_age_seconds", "NaN NaN NaN NaN NaN NaN NaN NaN NaN NaN NaN NaN NaN"),
        [("12m", "OutboxRelayXminHorizonOld", [])],
    ),
    "every replica down": (
        [_series("up", "1x2 0x10"), _series("up", "1x2 0x10", instance="b:9464")],
        [("5m", "OutboxRelayAbsent", []), ("10m", "OutboxRelayAbsent", [CRIT])],
    ),
}


def test_promtool_alert_behaviour(tmp_path: Path) -> None:
    tool = promtool()
    # promtool compares rendered annotations too; those are checked by
    # test_promtool_check_rules and the runbook test, so test a copy without them.
    doc = load_yaml(ALERTS_FILE)
    for group in doc["groups"]:
        for rule in group["rules"]:
            rule.pop("annotations", None)
    rules = tmp_path / "alerts.yml"
    rules.write_text(yaml.safe_dump(doc), encoding="utf-8")
    tests = []
    for name, (series, checks) in ALERT_CASES.items():
        tests.append(
            {
                "name": name,
                "interval": "1m",
                "input_series": series,
                "alert_rule_test": [
                    {"eval_time": at, "alertname": alert, "exp_alerts": [{"exp_labels": labels} for labels in expected]}
                    for at, alert, expected in checks
                ],
            }
        )
    spec = tmp_path / "alerts_test.yml"
    spec.write_text(
        yaml.safe_dump({"rule_files": [rules.name], "evaluation_interval": "1m", "tests": tests}), encoding="utf-8"
    )
    result = run([tool, "test", "rules", spec.name], cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_healthcheck_is_valid_python() -> None:
    """The exec-form HEALTHCHECK command is valid JSON and compilable `python -c` code."""
    (check,) = [args for kw, args in final_stage() if kw == "HEALTHCHECK"]
    cmd = check.split(" CMD ", 1)[1].strip()
    argv = exec_form(cmd)
    assert argv[:2] == ["python", "-c"]
    compile(argv[2], "<healthcheck>", "exec")
    assert shlex.split(check.split(" CMD ", 1)[0])  # options parse as flags
