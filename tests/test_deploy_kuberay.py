"""deploy/kuberay/rayjob.yaml against the RayJob CRD's schema (the v1 openAPIV3Schema of KubeRay
v1.7.0, vendored in deploy/kuberay/), validated the way ``kubectl apply`` with strict field
validation does (an unknown field is an error), plus what the schema cannot say: the Ray token
comes from a Secret, the worker group has GPUs, every pod mounts the run directory's volume,
and the claims it names are the ones deploy/kuberay/storage.yaml creates."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
KUBERAY = ROOT / "deploy" / "kuberay"
SCHEMA = KUBERAY / "rayjob-crd-v1.7.0.schema.json"
MANIFEST = KUBERAY / "rayjob.yaml"
STORAGE = KUBERAY / "storage.yaml"


def strict(schema):
    """The schema with ``additionalProperties: false`` on every object that lists its
    properties and neither sets additionalProperties nor preserves unknown fields: the API
    server's strict field validation, which rejects a field the CRD does not define."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items()}
    if ("properties" in out and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


@pytest.fixture(scope="module")
def validator():
    vendored = json.loads(SCHEMA.read_text())
    assert (vendored["kuberay_version"], vendored["crd"], vendored["version"]) == ("v1.7.0", "rayjobs.ray.io", "v1")
    schema = strict(vendored["openAPIV3Schema"])
    jsonschema.Draft4Validator.check_schema(schema)
    return jsonschema.Draft4Validator(schema)


def errors(validator, doc) -> list[str]:
    return sorted(f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc))


def rayjob() -> dict:
    return yaml.safe_load(MANIFEST.read_text())


def pods(job: dict) -> list[tuple[str, dict]]:
    spec = job["spec"]["rayClusterSpec"]
    return [("head", spec["headGroupSpec"]["template"]["spec"])] + [
        (g["groupName"], g["template"]["spec"]) for g in spec.get("workerGroupSpecs", [])]


def problems(job: dict, claims: set[str]) -> list[str]:
    """What the CRD schema cannot check, for a RayJob of molt-sdk: token authentication from
    a Secret, GPUs (limits = requests) on every worker group, the entry point joining the job's
    cluster, and in every pod the run directory (``--out``) and /dev/shm on volumes, the
    run directory on one of ``claims``."""
    bad = []
    spec = job["spec"]
    auth = spec["rayClusterSpec"].get("authOptions") or {}
    if auth.get("mode", "token") != "token" or not auth.get("secretName"):
        bad.append("authOptions: mode token with a secretName (a Secret holding key auth_token)")
    entry = spec.get("entrypoint", "")
    out = re.search(r"--out\s+(\S+)", entry)
    if not re.match(r"molt run \S+", entry) or "--ray-address auto" not in entry or not out:
        bad.append("entrypoint: `molt run RECIPE --ray-address auto --out DIR`")
    workers = spec["rayClusterSpec"].get("workerGroupSpecs", [])
    if not workers:
        bad.append("no worker group")
    for g in workers:
        res = g["template"]["spec"]["containers"][0].get("resources", {})
        want = res.get("limits", {}).get("nvidia.com/gpu")
        if not want or int(want) < 1 or res.get("requests", {}).get("nvidia.com/gpu", want) != want:
            bad.append(f"worker group {g['groupName']}: no nvidia.com/gpu limit (equal to its request)")
    for name, pod in pods(job):
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        mounts = {m["mountPath"]: m["name"] for c in pod["containers"] for m in c.get("volumeMounts", [])}
        run_mount = next((p for p in mounts if out and (out[1] + "/").startswith(p.rstrip("/") + "/")), None)
        claim = volumes.get(mounts.get(run_mount), {}).get("persistentVolumeClaim", {}).get("claimName")
        if claim not in claims:
            bad.append(f"{name}: the run directory is not on a shared volume (claims: {sorted(claims)})")
        if volumes.get(mounts.get("/dev/shm"), {}).get("emptyDir", {}).get("medium") != "Memory":
            bad.append(f"{name}: /dev/shm is not a memory emptyDir")
        for m in set(mounts.values()) - set(volumes):
            bad.append(f"{name}: volumeMount {m} names no volume")
    return bad


def storage_claims() -> set[str]:
    docs = [d for d in yaml.safe_load_all(STORAGE.read_text()) if d]
    assert all(d["kind"] == "PersistentVolumeClaim" and d["spec"]["accessModes"] == ["ReadWriteMany"] for d in docs)
    return {d["metadata"]["name"] for d in docs}


def test_rayjob_validates_against_the_crd_schema(validator):
    job = rayjob()
    assert (job["apiVersion"], job["kind"]) == ("ray.io/v1", "RayJob")
    assert errors(validator, job) == []


def test_rayjob_meets_what_the_schema_cannot_check():
    assert storage_claims() == {"molt-runs", "molt-hf-cache"}
    assert problems(rayjob(), storage_claims()) == []


@pytest.mark.parametrize("fault, expected", [
    # a misspelled field: strict validation names it
    (lambda j: j["spec"]["rayClusterSpec"].__setitem__("workerGroupSpec", j["spec"]["rayClusterSpec"]
                                                       .pop("workerGroupSpecs")),
     ["spec/rayClusterSpec: Additional properties are not allowed ('workerGroupSpec' was unexpected)"]),
    (lambda j: j["spec"]["rayClusterSpec"]["authOptions"].__setitem__("mode", "tokens"),
     ["spec/rayClusterSpec/authOptions/mode: 'tokens' is not one of ['disabled', 'token']"]),
    (lambda j: j["spec"]["rayClusterSpec"]["workerGroupSpecs"][0].__setitem__("replicas", "1"),
     ["spec/rayClusterSpec/workerGroupSpecs/0/replicas: '1' is not of type 'integer'"]),
    (lambda j: j["spec"]["rayClusterSpec"]["workerGroupSpecs"][0].pop("groupName"),
     ["spec/rayClusterSpec/workerGroupSpecs/0: 'groupName' is a required property"]),
])
def test_an_invalid_rayjob_fails_validation(validator, fault, expected):
    job = copy.deepcopy(rayjob())
    fault(job)
    assert errors(validator, job) == expected


def test_the_non_strict_schema_would_miss_a_misspelling(validator):
    """Why strict(): the CRD alone prunes unknown fields instead of rejecting them."""
    job = rayjob()
    job["spec"]["rayClusterSpec"]["headGroupSpec"]["rayStartParam"] = {"num-cpus": "0"}
    plain = jsonschema.Draft4Validator(json.loads(SCHEMA.read_text())["openAPIV3Schema"])
    assert errors(plain, job) == []
    assert errors(validator, job) == [
        "spec/rayClusterSpec/headGroupSpec: Additional properties are not allowed ('rayStartParam' was unexpected)"]


def test_a_rayjob_without_secret_gpus_or_shared_run_dir_is_flagged():
    job = rayjob()
    spec = job["spec"]["rayClusterSpec"]
    spec["authOptions"] = {"mode": "token"}
    worker = spec["workerGroupSpecs"][0]["template"]["spec"]
    del worker["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
    worker["volumes"] = [v for v in worker["volumes"] if v["name"] != "runs"]
    spec["headGroupSpec"]["template"]["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"] = "scratch"
    assert problems(job, storage_claims()) == [
        "authOptions: mode token with a secretName (a Secret holding key auth_token)",
        "worker group gpu: no nvidia.com/gpu limit (equal to its request)",
        "head: the run directory is not on a shared volume (claims: ['molt-hf-cache', 'molt-runs'])",
        "gpu: the run directory is not on a shared volume (claims: ['molt-hf-cache', 'molt-runs'])",
        "gpu: volumeMount runs names no volume",
    ]
    job = rayjob()
    job["spec"]["entrypoint"] = "python train.py"
    del job["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]["volumes"][2]
    assert problems(job, storage_claims()) == [
        "entrypoint: `molt run RECIPE --ray-address auto --out DIR`",
        "head: the run directory is not on a shared volume (claims: ['molt-hf-cache', 'molt-runs'])",
        "gpu: the run directory is not on a shared volume (claims: ['molt-hf-cache', 'molt-runs'])",
        "gpu: /dev/shm is not a memory emptyDir",
        "gpu: volumeMount dshm names no volume",
    ]
