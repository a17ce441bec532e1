#!/usr/bin/env python
"""Extract the ``v1`` OpenAPI schema of KubeRay's ``RayJob`` CRD into ``tests/fixtures/kuberay/`` (gzipped JSON).

The CRD (``ray-operator/config/crd/bases/ray.io_rayjobs.yaml`` in github.com/ray-project/kuberay) is 1.4 MB of YAML;
the test of ``examples/cluster/rayjob.yaml`` needs only its ``v1`` schema, which this keeps with the commit it came
from. Nothing is downloaded at test time.

Usage: python scripts/extract_rayjob_schema.py KUBERAY_CHECKOUT [--commit SHA]
"""

from __future__ import annotations

import argparse
import gzip
import json
import subprocess
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
CRD = "ray-operator/config/crd/bases/ray.io_rayjobs.yaml"
OUT = ROOT / "tests" / "fixtures" / "kuberay" / "rayjob_v1_schema.json.gz"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkout", type=Path, help="a KubeRay git checkout (or bare repository)")
    parser.add_argument("--commit", default="HEAD")
    args = parser.parse_args()
    git = ["git", f"--git-dir={args.checkout / '.git' if (args.checkout / '.git').exists() else args.checkout}"]
    sha = subprocess.run([*git, "rev-parse", args.commit], capture_output=True, text=True, check=True).stdout.strip()
    text = subprocess.run([*git, "show", f"{sha}:{CRD}"], capture_output=True, text=True, check=True).stdout
    crd = yaml.safe_load(text)
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    fixture = {"source": f"github.com/ray-project/kuberay@{sha}:{CRD}", "schema": version["schema"]["openAPIV3Schema"]}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    with gzip.GzipFile(OUT, "wb", mtime=0) as f:  # mtime 0: the same bytes on every run
        f.write(json.dumps(fixture, sort_keys=True, separators=(",", ":")).encode())
    print(f"wrote {OUT} ({OUT.stat().st_size:,} bytes) from {fixture['source']}")


if __name__ == "__main__":
    main()
