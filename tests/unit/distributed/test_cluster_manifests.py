"""``examples/cluster/rayjob.yaml`` against KubeRay's ``RayJob`` CRD (v1), as ``kubectl apply --validate=strict`` would
check it: the schema is the CRD's own, shipped as a fixture (``scripts/extract_rayjob_schema.py``; its source commit
is recorded in it), made strict the way the API server's field validation is (an unknown field is an error,
``int-or-string`` fields take either)."""

from __future__ import annotations

import copy
import gzip
import json
import shlex
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]
MANIFEST = ROOT / "examples" / "cluster" / "rayjob.yaml"
SCHEMA = ROOT / "tests" / "fixtures" / "kuberay" / "rayjob_v1_schema.json.gz"


def strict(schema: Any) -> Any:
    """The CRD's structural schema with Kubernetes' field validation spelled out for jsonschema."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items() if not k.startswith("x-kubernetes-")}
    if schema.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if "properties" in schema and "additionalProperties" not in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    if schema.get("nullable"):
        out.pop("nullable")
        out = {"anyOf": [out, {"type": "null"}]}
    return out


@pytest.fixture(scope="module")
def validator() -> jsonschema.Validator:
    with gzip.open(SCHEMA) as f:
        fixture = json.load(f)
    assert "kuberay" in fixture["source"]
    schema = strict(fixture["schema"])
    schema["properties"]["metadata"] = {"type": "object", "required": ["name"]}
    return jsonschema.Draft7Validator(schema)


def errors(validator: jsonschema.Validator, manifest: dict) -> list[str]:
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(manifest)]


def test_the_rayjob_example_is_a_valid_kuberay_v1_rayjob(validator: jsonschema.Validator) -> None:
    manifest = yaml.safe_load(MANIFEST.read_text())
    assert manifest["apiVersion"] == "ray.io/v1" and manifest["kind"] == "RayJob"
    assert errors(validator, manifest) == []
    entrypoint = manifest["spec"]["entrypoint"]
    workers = manifest["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    gpus = sum(g["replicas"] * int(g["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]) for g in workers)
    assert "cluster.num_nodes=1" in entrypoint and "cluster.gpus_per_node=8" in entrypoint and gpus == 1 * 8
    # The run the entrypoint starts reserves every GPU the manifest allocates (2 replicas for a recipe that reserves 8
    # left a whole node idle) and reads its recipe from the directory it cds to (the prompt file is relative to it).
    from nemo_like.algorithms.roles import idle_gpus_warning, role_requests
    from nemo_like.config import load_config
    from nemo_like.distributed.capacity import sum_resources
    from nemo_like.plan.run_plan import decide_run_plan

    # KubeRay runs `ray job submit ... -- ENTRYPOINT` through `bash -c`: a shell operator in the entrypoint ends the
    # submitted job there (`cd /app && nemo-like train ...` submitted `cd /app` and trained in the submitter pod), and so
    # does a newline (a literal block, `entrypoint: |-`, ran each override line as a command of its own), which shlex
    # would take for a space: it splits on spaces and tabs only here, so a newline comes out as a word and is refused
    lexer = shlex.shlex(entrypoint, posix=True, punctuation_chars=True)
    lexer.whitespace = " \t"
    words = list(lexer)
    assert not [w for w in words if set(w) <= set("&|;<>()\n")], words
    assert words[:3] == ["nemo-like", "train", "--config"]
    repo = str(Path(__file__).resolve().parents[3])
    command = [w.replace("/app/", repo + "/") for w in words[3:]]  # the image's /app holds the repository's examples/
    cfg = load_config(command[0], command[1:], warn=False)
    for path in (cfg.data.prompt_file, cfg.logger.log_dir, cfg.checkpointing.checkpoint_dir):  # no working directory to rely on
        assert Path(path).is_absolute(), path
    assert Path(cfg.data.prompt_file).is_file()
    plan = decide_run_plan(cfg, (), 64)
    assert sum_resources(r.total() for r in role_requests(cfg, plan))["GPU"] == gpus and idle_gpus_warning(cfg, plan) is None
    two = load_config(command[0], [*command[1:], "cluster.num_nodes=2"], warn=False)
    assert "16 GPUs, but the run's actors reserve 8: 8 would stay idle" in idle_gpus_warning(two, decide_run_plan(two, (), 64))


@pytest.mark.parametrize(
    ("path", "value", "expected"),
    [
        (("spec", "shutdownAfterJobFinish"), True, "Additional properties are not allowed ('shutdownAfterJobFinish'"),
        (("spec", "backoffLimit"), "none", "is not of type 'integer'"),
        (("spec", "rayClusterSpec", "headGroupSpec", "template", "spec", "containers", 0, "resource"), {}, "'resource' was unexpected"),
    ],
)
def test_a_misspelled_or_mistyped_field_is_refused(validator: jsonschema.Validator, path: tuple, value: Any, expected: str) -> None:
    manifest = copy.deepcopy(yaml.safe_load(MANIFEST.read_text()))
    node = manifest
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    assert any(expected in e for e in errors(validator, manifest)), errors(validator, manifest)
