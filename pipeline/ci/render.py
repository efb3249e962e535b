"""Render the GitHub Actions workflows from the registry, and check committed ones are current.

Templates use ``[[ ]]`` / ``[% %]`` delimiters so GitHub's own ``${{ }}`` expressions pass through
untouched. Every registry value goes through one filter, ``yaml_value``: a quoted YAML scalar that
can add no key and hold no GitHub expression. Scripts (``run:``) read registry values from ``env:``,
never as pasted text. Output is deterministic: the same registry renders the same bytes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.core.errors import ConfigError
from pipeline.core.io import atomic_write_bytes
from pipeline.project.config import NAME_PATTERN, Registry, SkuSpec
from pipeline.verify.selection import classes_of

WORKFLOW_DIR = Path(".github") / "workflows"
TEMPLATES = {"build.yml": "build.yml.j2", "promote.yml": "promote.yml.j2", "rollout.yml": "rollout.yml.j2"}
# rendered only while a SKU names an RPC tracker key (``tune_matrix``); removed when none does
TUNE_WORKFLOW = ("tune.yml", "tune.yml.j2")
# The tuning job's runner: a self-hosted x86 machine on the bench's network (it reaches the tracker
# and compiles the candidates; the devices behind the key measure them).
TUNE_RUNNER = ["self-hosted", "linux", "x64"]
# GitHub-hosted runners for CPU SKUs that do not ask for a self-hosted one.
HOSTED = {"x86_64": "ubuntu-24.04", "aarch64": "ubuntu-24.04-arm"}
# The package extra that carries each backend's SDK (pyproject.toml). ONNX Runtime is in every
# install (the `agent` extra under `pipeline`); a plugin backend's package is its runner's business.
BACKEND_EXTRAS: dict[str, tuple[str, ...]] = {
    "onnxruntime": (),
    "openvino": ("openvino",),
    "iree": ("iree",),
    "tvm": ("tvm",),
    "litert": ("litert",),
    "tensorrt": ("tensorrt",),
}
# What each job other than the SKU builds installs (`scripts/setup.sh --extras`, docs/ci.md): the
# registry check, assemble, select and promote run the build toolchain's commands but no compiler; the
# rollout job reads and signs the release store only (boto3 for S3).
JOB_EXTRAS = {
    "registry": "pipeline",
    "assemble": "pipeline",
    "select": "pipeline",
    "promote": "pipeline",
    "rollout": "agent",
}


def runs_on(sku: SkuSpec) -> list[str]:
    """A SKU's runner labels when they name a self-hosted runner; a hosted runner for other CPU SKUs."""
    if "self-hosted" not in sku.runner_labels and sku.target.device == "cpu" and sku.target.arch in HOSTED:
        return [HOSTED[sku.target.arch]]
    return list(sku.runner_labels)


def setup_extras(registry: Registry, sku: SkuSpec) -> str:
    """The extras a SKU's job installs: the build toolchain, the example models' trainers when the
    registry has examples (torch: setup.sh takes its CPU wheel) and the SKU's backend SDK only."""
    extras = ["pipeline"]
    if registry.examples:
        extras.append("examples")
    extras += BACKEND_EXTRAS.get(sku.backend, ())
    return ",".join(extras)


def setup_with(sku: SkuSpec) -> str:
    """System parts beyond pip a SKU's job needs (``scripts/setup.sh --with``): Mesa's software
    Vulkan driver for an IREE Vulkan SKU; on a Jetson, JetPack's TensorRT, which is no wheel but
    the system Python's package (the venv sees it through --system-site-packages)."""
    parts = []
    if sku.backend == "iree" and sku.options.get("target_device") == "vulkan":
        parts.append("vulkan")
    if sku.backend == "tensorrt" and sku.target.arch == "aarch64":
        parts.append("system-site-packages")
    return ",".join(parts)


def matrix(registry: Registry) -> list[dict[str, Any]]:
    """One entry per SKU built in CI (``ci: true``), in registry order: what the build job's matrix
    lists, with what the job's setup step installs."""
    return [
        {"sku": name, "runs-on": runs_on(sku), "extras": setup_extras(registry, sku), "with": setup_with(sku)}
        for name, sku in registry.skus.items()
        if sku.ci
    ]


def select_models(registry: Registry) -> list[str]:
    """The models the select job chooses an engine for: those with a SKU that names a device class."""
    return [model for model in sorted(registry.models) if classes_of(registry, model)]


def rpc_key(sku: SkuSpec) -> str | None:
    """The RPC tracker key a TVM SKU's candidates are measured under (``options.rpc.key``), if any."""
    rpc = sku.options.get("rpc") if sku.backend == "tvm" else None
    return rpc.get("key") if isinstance(rpc, dict) else None


def tune_matrix(registry: Registry) -> list[dict[str, Any]]:
    """One entry per SKU with an RPC tracker key, in registry order: the tuning job's matrix. The
    job runs on the x86 tuning runner, so a SKU for another architecture installs its cross GCC."""
    return [
        {
            "sku": name,
            "runs-on": TUNE_RUNNER,
            "extras": setup_extras(registry, sku),
            "with": f"cross-{sku.target.arch}" if sku.target.arch != "x86_64" else "",
        }
        for name, sku in registry.skus.items()
        if rpc_key(sku)
    ]


def _environment():
    import jinja2

    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(Path(__file__).parent / "templates")),
        variable_start_string="[[",
        variable_end_string="]]",
        block_start_string="[%",
        block_end_string="%]",
        comment_start_string="[#",
        comment_end_string="#]",
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        undefined=jinja2.StrictUndefined,
        autoescape=False,
        finalize=_serialized,
    )


class _Serialized(str):
    """Text made by ``yaml_value``: the only kind a template may print."""


def _serialized(value: Any) -> str:
    if not isinstance(value, _Serialized):
        raise TypeError(f"a template prints {value!r} without '| yaml_value'")  # a template bug, not a user error
    return value


def yaml_value(value: Any) -> str:
    """``value`` as one YAML flow value on one line (JSON is YAML: quotes, escapes, no comments).

    GitHub evaluates ``${{`` in any string, quoted or not, so a value holding it is refused.
    """
    refuse_expressions(value)
    text = json.dumps(value)
    if "${{" in text:  # not in any one string: made by joining them
        raise ConfigError(
            f"registry value {value!r} holds '${{{{': GitHub would evaluate it as an expression",
            hint="rename it in params.yaml (see the name rule in docs/registry.md)",
        )
    return _Serialized(text)


def refuse_expressions(value: Any) -> None:
    """ConfigError naming the first string in ``value`` (nested lists and dicts, keys included)
    that holds ``${{``: the registry name, not the whole document it ends up in."""
    if isinstance(value, dict):
        for k, v in value.items():
            refuse_expressions(k)
            refuse_expressions(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            refuse_expressions(v)
    elif isinstance(value, str) and "${{" in value:
        raise ConfigError(
            f"registry value {value!r} holds '${{{{': GitHub would evaluate it as an expression",
            hint="rename it in params.yaml (see the name rule in docs/registry.md)",
        )


def workflows(registry: Registry) -> dict[str, str]:
    """File name -> rendered text of every workflow the registry describes."""
    env = _environment()
    env.filters["yaml_value"] = yaml_value
    release = registry.release
    entries = matrix(registry)
    tuning = tune_matrix(registry)
    selecting = select_models(registry)
    refuse_expressions([entries, tuning])  # checked whole here: each is printed as one JSON string below
    context = {
        # the plan job filters it (self-hosted SKUs only where the repository says it has those
        # runners) and hands it to the SKU jobs; JSON in an env value, read by jq, never pasted
        "matrix_json": json.dumps(entries, separators=(",", ":")),
        "job_extras": JOB_EXTRAS,
        "models": sorted(registry.models),
        "aliases": list(release.aliases),
        "skus": list(registry.skus),
        # the rollout workflow checks a dispatched model name with the registry's own rule
        "model_rule": f"^{NAME_PATTERN.pattern}$",
        "tune_matrix_json": json.dumps(tuning, separators=(",", ":")),
        # the select job's models: JSON in an env value, read by jq, never pasted into its script
        "select_models": selecting,
        "select_models_json": json.dumps(selecting, separators=(",", ":")),
        "tune_skus": [entry["sku"] for entry in tuning],
    }
    templates = dict(TEMPLATES, **dict([TUNE_WORKFLOW] if tuning else []))
    return {name: env.get_template(template).render(**context) for name, template in templates.items()}


@dataclass
class RenderResult:
    directory: Path
    files: list[str]  # every rendered file, relative to the project root
    differ: list[str]  # files whose content differs from (or is missing in) the directory

    def to_json(self) -> dict[str, Any]:
        return {"directory": str(self.directory), "files": self.files, "differ": self.differ}


def render(registry: Registry, output: Path | None = None, check: bool = False) -> RenderResult:
    """Write the workflows into ``output`` (default: .github/workflows/ at the project root).

    With ``check`` nothing is written; ``differ`` lists the files that are stale or missing.
    """

    directory = Path(output) if output is not None else registry.root / WORKFLOW_DIR
    files, differ = [], []
    rendered = workflows(registry)
    stale = directory / TUNE_WORKFLOW[0]
    if TUNE_WORKFLOW[0] not in rendered and stale.is_file():  # no SKU names a tracker key any more
        differ.append(_shown(stale, registry.root))
        if not check:
            stale.unlink()
    for name, text in rendered.items():
        path = directory / name
        shown = _shown(path, registry.root)
        files.append(shown)
        current = path.read_bytes() if path.is_file() else None
        if current == text.encode():
            continue
        differ.append(shown)
        if not check:
            atomic_write_bytes(path, text.encode())
    return RenderResult(directory, files, differ)


def _shown(path: Path, root: Path) -> str:
    try:
        return str(path.resolve().relative_to(root.resolve()))
    except ValueError:
        return str(path)
