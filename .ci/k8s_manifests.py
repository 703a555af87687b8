#!/usr/bin/env python3
"""Validates deploy/kubernetes/ and the Helm chart deploy/helm/sandboxd against the Kubernetes schemas.

Run with the Python of a venv that has kubernetes-validate (and so PyYAML):
    k8s_manifests.py KUBERNETES_VERSION

helm cannot be installed from the registries CI reaches (no Debian package; PyPI's `helm` is an unrelated
project), so the chart is rendered here: its templates may only use `{{ .Values.a.b }}` and
`{{ .Release.Namespace }}` (optionally `| quote`), anything else fails. Rendered with the chart's default values,
it must be the plain manifests object for object (but the Namespace, which `helm install --create-namespace`
makes). Then every plain manifest and every rendered template is validated (strict: unknown fields fail), and a
manifest with an unknown field must fail, so the validation is known to reject something.
"""

import json
import pathlib
import re
import subprocess
import sys
import tempfile

import yaml

ROOT = pathlib.Path(__file__).resolve().parent.parent
PLAIN = ROOT / "deploy/kubernetes"
CHART = ROOT / "deploy/helm/sandboxd"
RELEASE = {"Namespace": "sandboxd", "Name": "sandboxd"}
ACTION = re.compile(r"{{-?\s*(.*?)\s*-?}}")
ALLOWED = re.compile(r"^\.(Values|Release)((?:\.\w+)+)(\s*\|\s*quote)?$")


def render(text, values, where):
    def one(match):
        m = ALLOWED.match(match.group(1))
        if not m:
            sys.exit(f"{where}: template action {match.group(0)!r} is not a plain value")
        value = values if m.group(1) == "Values" else RELEASE
        for key in m.group(2).strip(".").split("."):
            if not isinstance(value, dict) or key not in value:
                sys.exit(f"{where}: {match.group(0)!r} names no value")
            value = value[key]
        return json.dumps(str(value)) if m.group(3) else str(value)

    return ACTION.sub(one, text)


def objects(texts):
    found = {}
    for where, text in texts:
        for doc in yaml.safe_load_all(text):
            if doc:
                found[(doc["kind"], doc["metadata"]["name"])] = (where, doc)
    return found


def validate(version, files):
    out = subprocess.run(
        [sys.executable, "-m", "kubernetes_validate", "--strict", "-k", version, *map(str, files)],
        capture_output=True,
        text=True,
    )
    return out.returncode, out.stdout + out.stderr


def main():
    version = sys.argv[1]
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    yaml.safe_load((CHART / "Chart.yaml").read_text())
    plain_files = sorted(PLAIN.glob("*.yaml"))
    templates = sorted((CHART / "templates").glob("*.yaml"))
    with tempfile.TemporaryDirectory() as tmp:
        rendered = []
        for t in templates:
            path = pathlib.Path(tmp) / t.name
            path.write_text(render(t.read_text(), values, t.relative_to(ROOT)))
            rendered.append(path)
        plain = objects((f.name, f.read_text()) for f in plain_files)
        chart = objects((f.name, f.read_text()) for f in rendered)
        plain_in_chart = {k: v for k, v in plain.items() if k[0] != "Namespace"}
        if plain_in_chart.keys() != chart.keys():
            sys.exit(f"the chart renders {sorted(chart)}, deploy/kubernetes has {sorted(plain_in_chart)}")
        for key, (where, doc) in plain_in_chart.items():
            if chart[key][1] != doc:
                sys.exit(f"{key}: the chart's {chart[key][0]} differs from deploy/kubernetes/{where}")
        print(f"chart: {len(templates)} templates render the {len(chart)} objects of deploy/kubernetes")

        rc, out = validate(version, plain_files + rendered)
        passed = out.count(" passed for resource ")
        print(out.strip())
        if rc != 0:
            sys.exit(f"kubernetes-validate failed (exit {rc})")
        want = len(plain) + len(chart)
        if passed != want:
            sys.exit(f"{passed} objects passed, {want} expected")
        print(f"kubernetes-validate {version} (strict): {len(plain)} objects in {len(plain_files)} manifests "
              f"and {len(chart)} rendered from the chart, all passed")

        broken = yaml.safe_load((PLAIN / "daemonset.yaml").read_text())
        broken["spec"]["template"]["spec"]["containers"][0]["livenessProb"] = {}
        bad = pathlib.Path(tmp) / "broken.yaml"
        bad.write_text(yaml.safe_dump(broken))
        rc, out = validate(version, [bad])
        if rc == 0:
            sys.exit(f"a DaemonSet with an unknown field passed validation:\n{out}")
        print("a DaemonSet with an unknown field fails, as it must")


if __name__ == "__main__":
    main()
