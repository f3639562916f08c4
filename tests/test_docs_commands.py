"""What the README and docs/ tell a user to run is what the code accepts: every
``tickserve`` subcommand and flag in their command blocks exists, every mode ``--help``
lists is explained in the README, the cheap commands run as written, and the Kubernetes
manifests of docs/deploy-kubernetes.md validate (built-in kinds against Kubernetes'
schemas, the InferencePool against its CRD's schema)."""

from __future__ import annotations

import copy
import re
import subprocess
import sys

import jsonschema
import kubernetes_validate
import pytest
import yaml

from shared import config as cfg
from tests.procs import REPO, _env

KUBERNETES_VERSION = "1.34.0"  # the schemas kubernetes-validate checks the built-in kinds against
README = (REPO / "README.md").read_text()
DOCS = {p.name: p.read_text() for p in (REPO / "docs").glob("*.md")}

# every flag whose --help lists modes, and the modes (from the code where it names them)
MODES = {
    "prefill_mode": [m.value for m in cfg.PrefillMode],
    "policy": [m.value for m in cfg.PolicyName],
    "backend": [m.value for m in cfg.BackendName],
    "kernels": ["auto", "c", "torch"],
    "quantization": ["auto", "none", "int8", "int4"],
    "transport": ["auto", "shm", "zmq"],
    "routing": ["affinity", "round_robin"],
    "device": list(cfg.DEVICES),
    "dtype": list(cfg.DTYPE_NAMES),
}


def _blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


def _tickserve(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shared.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env={**_env(), **(env or {})})


def _help_text(cls) -> dict[str, str]:
    import dataclasses

    return {f.name: f.metadata.get("help", "") for f in dataclasses.fields(cls)}


def test_every_mode_help_lists_is_explained_in_the_readme():
    helps = {**_help_text(cfg.EngineConfig), **_help_text(cfg.FrontendConfig)}
    for name, modes in MODES.items():
        flag = "--" + name.replace("_", "-")
        assert f"`{flag}`" in README, f"{flag} is not in the README"
        for mode in modes:
            assert re.search(rf"\b{re.escape(mode)}\b", helps[name]), f"{flag}'s help does not list {mode}"
            assert f"`{mode}`" in README or f"{mode} (" in README, f"the README does not explain {flag} {mode}"


def test_help_names_the_scheduler_page_not_the_card():
    out = _tickserve("serve", "--help").stdout
    assert "(card:" not in out and "docs/scheduler.md" in out
    for name in ("MAX_QUEUE_SIZE", "MAX_BATCH_SIZE", "PREFILL_CHUNK_SIZE"):
        assert name in out and name in DOCS["scheduler.md"]


def test_every_tickserve_command_in_the_docs_names_real_subcommands_and_flags():
    known = {sub: _tickserve(sub, "--help").stdout for sub in ("serve", "engine", "frontend", "cache", "convert")}
    commands = []
    for text in [README, *DOCS.values()]:
        for block in _blocks(text, "bash"):
            joined = re.sub(r"\\\n\s*", " ", block)
            commands += re.findall(r"(?:^|[\s(\"$])(?:\.venv/bin/)?tickserve (\w+)([^\n#|;)]*)", joined, re.M)
    assert len(commands) >= 6, commands
    for sub, rest in commands:
        assert sub in known, f"tickserve {sub} is not a subcommand"
        for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", rest):
            assert flag in known[sub], f"tickserve {sub} has no {flag}"


def test_the_documented_tools_exist_and_the_bench_tokenizer_comes_from_convert():
    for path in sorted(set(re.findall(r"tools/[\w.]+\.(?:py|sh)", README + "".join(DOCS.values())))):
        assert (REPO / path).exists(), path
    assert "~/.cache/tickserve/models" not in "".join(_blocks(README, "bash"))  # wrong when TICKSERVE_CACHE_DIR is set
    assert '--tokenizer "$(.venv/bin/tickserve convert --hf)"' in README
    assert "pip install lm_eval" in README  # lmeval_check.py's dependency, named where it is used


def test_the_cheap_readme_commands_run_as_written(tmp_path):
    top = _tickserve("--help")
    assert top.returncode == 0 and all(f"tickserve {s}" in top.stdout for s in ("serve", "engine", "cache"))
    listing = _tickserve("cache", env={"TICKSERVE_CACHE_DIR": str(tmp_path)})
    assert listing.returncode == 0 and f"0 entries in {tmp_path}" in listing.stdout
    pruned = _tickserve("cache", "prune", env={"TICKSERVE_CACHE_DIR": str(tmp_path)})
    assert pruned.returncode == 0 and "freed 0 MB" in pruned.stdout


def _manifests() -> list[dict]:
    docs = []
    for block in _blocks(DOCS["deploy-kubernetes.md"], "yaml"):
        docs += [d for d in yaml.safe_load_all(block) if d is not None]
    return docs


def _strict(schema: dict) -> dict:
    """``schema`` with unknown fields refused (kubectl's strict field validation)."""
    schema = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, dict):
            if node.get("type") == "object" and "properties" in node and "additionalProperties" not in node:
                node["additionalProperties"] = False
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)
    walk(schema)
    return schema


def _pool_validator() -> jsonschema.Draft7Validator:
    crd = yaml.safe_load((REPO / "tests" / "data" / "inferencepool-crd-v1.yaml").read_text())
    schema = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")["schema"]["openAPIV3Schema"]
    return jsonschema.Draft7Validator(_strict(schema))


def test_the_kubernetes_manifests_validate():
    manifests = _manifests()
    kinds = sorted(m["kind"] for m in manifests)
    assert kinds == ["Deployment", "Deployment", "InferencePool", "Service", "Service"], kinds
    for m in manifests:
        if m["kind"] == "InferencePool":
            assert m["apiVersion"] == "inference.networking.k8s.io/v1"
            _pool_validator().validate(m)
        else:
            kubernetes_validate.validate(m, KUBERNETES_VERSION, strict=True)
    deployment = next(m for m in manifests if m["metadata"]["name"] == "tickserve-smollm2" and m["kind"] == "Deployment")
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[0] == "serve" and all(a in _tickserve("serve", "--help").stdout
                                      for a in args if a.startswith("--"))


@pytest.mark.parametrize("damage", ["typo", "bad_port", "no_selector"])
def test_the_checks_catch_a_broken_manifest(damage):
    pool = next(m for m in _manifests() if m["kind"] == "InferencePool")
    broken = copy.deepcopy(pool)
    if damage == "typo":
        broken["spec"]["targetPort"] = broken["spec"].pop("targetPorts")
    elif damage == "bad_port":
        broken["spec"]["targetPorts"][0]["number"] = 70000
    else:
        del broken["spec"]["selector"]
    with pytest.raises(jsonschema.ValidationError):
        _pool_validator().validate(broken)
    service = copy.deepcopy(next(m for m in _manifests() if m["kind"] == "Service"))
    service["spec"]["ports"][0]["prot"] = 8000
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(service, KUBERNETES_VERSION, strict=True)
