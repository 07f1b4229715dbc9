"""The cluster definitions under ``cluster/``: they parse, pass Ray's own validation, and
carry what KubeRay and a spot fleet need. Fast, offline: nothing here talks to AWS or
Kubernetes, and no Ray cluster is started."""

from __future__ import annotations

import ast
import copy
import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

CLUSTER = Path(__file__).resolve().parent.parent / "cluster"
LAUNCHER = CLUSTER / "aws-spot-gpu.yaml"
RAYJOB = CLUSTER / "kuberay-rayjob.yaml"
SUBMIT = CLUSTER / "submit.sh"
WATCHER = CLUSTER / "spot_notice_watcher.sh"
TRAIN = CLUSTER / "train_spot.py"
SPOT_SELECTOR = ("eks.amazonaws.com/capacityType", "SPOT")


def load(path: Path) -> Any:
    with open(path) as f:
        return yaml.safe_load(f)


# ---------------------------------------------------------------- every YAML
@pytest.mark.parametrize("path", sorted(CLUSTER.glob("*.yaml")), ids=lambda p: p.name)
def test_every_yaml_parses_to_a_mapping(path: Path) -> None:
    assert isinstance(load(path), dict), f"{path.name}: not a YAML mapping"


def test_the_cluster_folder_has_what_the_guide_names() -> None:
    for path in (LAUNCHER, RAYJOB, SUBMIT, WATCHER, TRAIN, CLUSTER / "Dockerfile", CLUSTER / "README.md"):
        assert path.is_file(), f"{path} is missing"
    guide = (CLUSTER / "README.md").read_text()
    for name in ("aws-spot-gpu.yaml", "kuberay-rayjob.yaml", "submit.sh", "train_spot.py", "/dev/shm", "s3://"):
        assert name in guide, f"cluster/README.md never mentions {name}"


# ---------------------------------------------------------------- launcher config
def ray_validate(config: dict) -> dict:
    """What `ray up` checks before it calls the cloud: defaults merged in, then Ray's JSON schema."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)
    return prepared


def test_launcher_config_passes_rays_schema_validation() -> None:
    prepared = ray_validate(load(LAUNCHER))
    assert prepared["provider"]["type"] == "aws"
    assert prepared["head_node_type"] in prepared["available_node_types"]


@pytest.mark.parametrize("breakage", ["resources", "node_config", "head_node_type", "unknown_top_level_key",
                                      "min_over_max"])
def test_rays_validation_rejects_a_broken_launcher_config(breakage: str) -> None:
    """The validation above is live: each of these breaks it."""
    import jsonschema

    config = load(LAUNCHER)
    gpu_type = next(name for name in config["available_node_types"] if name != config["head_node_type"])
    if breakage in ("resources", "node_config"):
        del config["available_node_types"][gpu_type][breakage]
    elif breakage == "head_node_type":
        config["head_node_type"] = "no-such-type"
    elif breakage == "unknown_top_level_key":
        config["max_worker"] = 3
    else:
        config["available_node_types"][gpu_type]["min_workers"] = config["max_workers"] + 1
    with pytest.raises((jsonschema.ValidationError, ValueError)):
        ray_validate(config)


def gpu_types(config: dict) -> dict[str, dict]:
    return {name: spec for name, spec in config["available_node_types"].items() if name != config["head_node_type"]}


def test_head_is_an_on_demand_cpu_node() -> None:
    config = load(LAUNCHER)
    head = config["available_node_types"][config["head_node_type"]]
    assert head["resources"].get("GPU", 0) == 0
    assert "InstanceMarketOptions" not in head["node_config"], "the head must not be a spot instance"


def test_gpu_workers_are_spot_of_several_types_with_autoscaler_bounds() -> None:
    config = load(LAUNCHER)
    workers = gpu_types(config)
    instance_types = {spec["node_config"]["InstanceType"] for spec in workers.values()}
    assert len(instance_types) >= 3, f"only {instance_types}: several spot pools are the point"
    for name, spec in workers.items():
        assert spec["node_config"]["InstanceMarketOptions"]["MarketType"] == "spot", name
        assert spec["resources"]["GPU"] >= 1, name
        assert 0 <= spec["min_workers"] <= spec["max_workers"], name
        assert spec["node_config"].get("IamInstanceProfile"), f"{name}: workers persist to S3, they need a role"
    assert sum(spec["min_workers"] for spec in workers.values()) <= config["max_workers"]
    assert max(spec["max_workers"] for spec in workers.values()) <= config["max_workers"]


def test_every_node_installs_this_package_and_workers_watch_spot_notices() -> None:
    config = load(LAUNCHER)
    mounted = {remote: local for remote, local in config["file_mounts"].items()}
    repo_on_node = next(remote for remote, local in mounted.items() if local == ".")
    installs = [c for c in config["setup_commands"] if "pip install" in c and repo_on_node in c]
    assert installs, f"no setup command installs the package copied to {repo_on_node}"
    watcher = [c for c in config["worker_start_ray_commands"] if WATCHER.name in c]
    assert watcher and f"{repo_on_node}/cluster/{WATCHER.name}" in watcher[0]
    ray_start = next(i for i, c in enumerate(config["worker_start_ray_commands"]) if "ray start" in c)
    assert config["worker_start_ray_commands"].index(watcher[0]) > ray_start, "the watcher needs a running raylet"


# ---------------------------------------------------------------- KubeRay RayJob
def _string_map(value: Any) -> bool:
    return isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())


def _pod_problems(where: str, group: dict) -> list[str]:
    problems = []
    if not _string_map(group.get("rayStartParams")):
        problems.append(f"{where}.rayStartParams: a mapping of strings is required")
    containers = (((group.get("template") or {}).get("spec") or {}).get("containers")) or []
    if not containers:
        problems.append(f"{where}.template.spec.containers: at least one container is required")
    for i, container in enumerate(containers):
        for field in ("name", "image"):
            if not container.get(field):
                problems.append(f"{where}.template.spec.containers[{i}].{field} is required")
    return problems


def rayjob_problems(doc: dict) -> list[str]:
    """The fields KubeRay (ray.io/v1) needs before it will create the cluster and the job."""
    problems = []
    if doc.get("apiVersion") != "ray.io/v1":
        problems.append(f"apiVersion {doc.get('apiVersion')!r}: must be ray.io/v1")
    if doc.get("kind") != "RayJob":
        problems.append(f"kind {doc.get('kind')!r}: must be RayJob")
    name = (doc.get("metadata") or {}).get("name", "")
    if not re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", name):
        problems.append(f"metadata.name {name!r}: a DNS-1123 label is required")
    spec = doc.get("spec") or {}
    if not isinstance(spec.get("entrypoint"), str) or not spec["entrypoint"].strip():
        problems.append("spec.entrypoint is required")
    cluster = spec.get("rayClusterSpec") or {}
    problems += _pod_problems("headGroupSpec", cluster.get("headGroupSpec") or {})
    groups = cluster.get("workerGroupSpecs") or []
    if not groups:
        problems.append("rayClusterSpec.workerGroupSpecs: at least one worker group is required")
    for group in groups:
        where = f"workerGroupSpecs[{group.get('groupName')!r}]"
        missing = [f for f in ("groupName", "replicas", "minReplicas", "maxReplicas", "template") if f not in group]
        problems += [f"{where}.{f} is required" for f in missing]
        if not missing and not 0 <= group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]:
            problems.append(f"{where}: need minReplicas <= replicas <= maxReplicas")
        problems += _pod_problems(where, group)
    return problems


def ray_pods(doc: dict) -> dict[str, dict]:
    cluster = doc["spec"]["rayClusterSpec"]
    pods = {"head": cluster["headGroupSpec"]["template"]["spec"]}
    pods.update({g["groupName"]: g["template"]["spec"] for g in cluster["workerGroupSpecs"]})
    return pods


def gpu_groups(doc: dict) -> list[dict]:
    return [g for g in doc["spec"]["rayClusterSpec"]["workerGroupSpecs"]
            if any("nvidia.com/gpu" in (c.get("resources") or {}).get("limits", {})
                   for c in g["template"]["spec"]["containers"])]


def test_rayjob_carries_the_fields_kuberay_requires() -> None:
    doc = load(RAYJOB)
    assert rayjob_problems(doc) == []
    spec = doc["spec"]
    assert spec["shutdownAfterJobFinishes"] is True
    assert isinstance(spec["backoffLimit"], int) and spec["backoffLimit"] >= 0
    assert "train_spot.py" in spec["entrypoint"] and "s3://" in spec["entrypoint"]
    assert isinstance(yaml.safe_load(spec["runtimeEnvYAML"]), dict)


@pytest.mark.parametrize("path, expected", [
    (("apiVersion",), "apiVersion"), (("metadata", "name"), "metadata.name"), (("spec", "entrypoint"), "entrypoint"),
    (("spec", "rayClusterSpec", "headGroupSpec", "template", "spec", "containers"), "headGroupSpec.template"),
    (("spec", "rayClusterSpec", "headGroupSpec", "rayStartParams"), "headGroupSpec.rayStartParams"),
    (("spec", "rayClusterSpec", "workerGroupSpecs", 0, "maxReplicas"), "maxReplicas"),
    (("spec", "rayClusterSpec", "workerGroupSpecs", 0, "groupName"), "groupName"),
])
def test_rayjob_check_names_a_dropped_field(path: tuple, expected: str) -> None:
    doc = load(RAYJOB)
    parent = doc
    for key in path[:-1]:
        parent = parent[key]
    del parent[path[-1]]
    problems = rayjob_problems(doc)
    assert any(expected in p for p in problems), problems


def test_spot_selector_and_toleration_are_on_the_gpu_group_only() -> None:
    doc = load(RAYJOB)
    groups = gpu_groups(doc)
    assert groups, "no worker group requests nvidia.com/gpu"
    key, value = SPOT_SELECTOR
    for group in groups:
        pod = group["template"]["spec"]
        assert pod["nodeSelector"].get(key) == value, group["groupName"]
        tolerated = {(t["key"], t.get("effect")) for t in pod["tolerations"]}
        assert ("spot", "NoSchedule") in tolerated and ("nvidia.com/gpu", "NoSchedule") in tolerated
    head = doc["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    assert head.get("nodeSelector", {}).get(key) != value, "the head must not run on spot capacity"


def quantity_bytes(text: str | int) -> int:
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "K": 10**3, "M": 10**6, "G": 10**9}
    match = re.fullmatch(r"(\d+)([KMGT]i?)?", str(text))
    assert match, f"cannot read the quantity {text!r}"
    return int(match.group(1)) * units.get(match.group(2) or "", 1)


def test_dev_shm_is_memory_backed_and_mounted_in_every_ray_container() -> None:
    doc = load(RAYJOB)
    for name, pod in ray_pods(doc).items():
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        for container in pod["containers"]:
            mounts = [m for m in container.get("volumeMounts", []) if m["mountPath"] == "/dev/shm"]
            assert mounts, f"{name}/{container['name']}: no volume at /dev/shm (64 MiB by default)"
            empty_dir = volumes[mounts[0]["name"]].get("emptyDir") or {}
            assert empty_dir.get("medium") == "Memory", f"{name}: /dev/shm must be memory-backed"
            size = quantity_bytes(empty_dir["sizeLimit"])
            memory_limit = quantity_bytes(container["resources"]["limits"]["memory"])
            assert size < memory_limit, f"{name}: /dev/shm is charged to the container's memory limit"


def test_gpu_shm_holds_the_object_store_and_two_slots() -> None:
    doc = load(RAYJOB)
    for group in gpu_groups(doc):
        pod = group["template"]["spec"]
        volume = next(v for v in pod["volumes"] if (v.get("emptyDir") or {}).get("medium") == "Memory")
        shm = quantity_bytes(volume["emptyDir"]["sizeLimit"])
        object_store = int(group["rayStartParams"]["object-store-memory"])
        assert shm - object_store >= 2 * (1 << 30), f"{group['groupName']}: no room for two snapshot slots"


# ---------------------------------------------------------------- scripts
@pytest.mark.parametrize("script", [SUBMIT, WATCHER], ids=lambda p: p.name)
def test_shell_scripts_parse_and_are_executable(script: Path) -> None:
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert script.stat().st_mode & stat.S_IXUSR, f"{script.name} is not executable"


def _fake_ray(tmp_path: Path) -> dict[str, str]:
    """A `ray` on PATH that records its arguments, one per line."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "ray"
    fake.write_text(f"#!/usr/bin/env bash\nprintf '%s\\n' \"$@\" > {tmp_path / 'args'}\n")
    fake.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}


def test_submit_script_runs_ray_job_submit_with_the_entrypoint(tmp_path: Path) -> None:
    env = {**_fake_ray(tmp_path), "STORAGE_PATH": "s3://bucket/runs", "RUN_NAME": "r1", "AWS_REGION": "eu-west-1"}
    env.pop("RAY_ADDRESS", None)
    result = subprocess.run([str(SUBMIT), "--workers", "2-4"], env=env, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    args = (tmp_path / "args").read_text().splitlines()
    assert args[:2] == ["job", "submit"]
    assert args[args.index("--working-dir") + 1] == str(CLUSTER)
    assert args[args.index("--address") + 1] == "http://127.0.0.1:8265"
    runtime_env = json.loads(args[args.index("--runtime-env-json") + 1])
    assert runtime_env["env_vars"]["AWS_REGION"] == "eu-west-1"
    assert runtime_env["env_vars"]["RAY_TRAIN_ENABLE_PRINT_PATCH"] == "0"  # each printed line once
    entrypoint = args[args.index("--") + 1:]
    assert entrypoint == ["python", "train_spot.py", "--storage-path", "s3://bucket/runs", "--name", "r1",
                          "--workers", "2-4"]


def test_submit_script_refuses_to_run_without_a_storage_path(tmp_path: Path) -> None:
    env = _fake_ray(tmp_path)
    env.pop("STORAGE_PATH", None)
    result = subprocess.run([str(SUBMIT)], env=env, capture_output=True, text=True, timeout=30)
    assert result.returncode != 0 and "STORAGE_PATH" in result.stderr
    assert not (tmp_path / "args").exists(), "ray was called without a storage path"


# ---------------------------------------------------------------- training entrypoint
def _calls(tree: ast.AST) -> dict[str, list[ast.Call]]:
    found: dict[str, list[ast.Call]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            found.setdefault(name, []).append(node)
    return found


def _keyword(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def test_train_script_uses_checkfreq_as_the_readme_shows() -> None:
    source = TRAIN.read_text()
    tree = ast.parse(source, filename=str(TRAIN))
    functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    train_calls = _calls(functions["train_func"])
    for needed in ("CheckFreq", "restore", "step", "close", "resumable", "prepare_model"):
        assert needed in train_calls, f"train_func never calls {needed}"
    assert "prepare_data_loader" not in train_calls, "resumable() replaces prepare_data_loader"
    trainer_calls = _calls(functions["build_trainer"])
    max_failures = _keyword(trainer_calls["FailureConfig"][0], "max_failures")
    assert max_failures is not None and ast.literal_eval(max_failures) == -1
    assert isinstance(_keyword(trainer_calls["ScalingConfig"][0], "use_gpu"), ast.expr)
    callbacks = _keyword(trainer_calls["RunConfig"][0], "callbacks")
    assert callbacks is not None and "CheckFreqCallback" in ast.unparse(callbacks)
    assert _keyword(trainer_calls["RunConfig"][0], "storage_path") is not None


def test_train_script_imports_without_ray_and_its_pieces_work() -> None:
    """In a fresh interpreter: importing the script and using its pure parts starts no Ray."""
    probe = f"""
import importlib.util, sys
spec = importlib.util.spec_from_file_location("train_spot", {str(TRAIN)!r})
mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
a, b = mod.make_dataset(64, 8, seed=3), mod.make_dataset(64, 8, seed=3)
assert all((x == y).all() for x, y in zip(a.tensors, b.tensors))
out = mod.make_model(8, 16, 1)(a.tensors[0])
assert tuple(out.shape) == (64, mod.NUM_CLASSES)
args = mod.parse_args(["--storage-path", "s3://b/p", "--workers", "2-4", "--global-batch", "96"])
assert args.workers == (2, 4) and args.storage_path == "s3://b/p"
assert mod.parse_workers("3") == 3
try:
    mod.check_global_batch(100, (2, 4))
except ValueError as e:
    assert "[3]" in str(e) and "multiple of 12" in str(e), e
else:
    raise AssertionError("a global batch 3 does not divide was accepted")
assert callable(mod.train_func) and callable(mod.build_trainer)
assert "ray" not in sys.modules, "importing the training script imported ray"
print("ok")
"""
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-2000:]
