"""Render the GitHub Actions workflows from the registry, and check committed ones are current.

Templates use ``[[ ]]`` / ``[% %]`` delimiters so GitHub's own ``${{ }}`` expressions pass through
untouched. Every registry value goes through one filter, ``yaml_value``: a quoted YAML scalar that
can add no key and hold no GitHub expression. Scripts (``run:``) read registry values from ``env:``,
never as pasted text. Output is deterministic: the same registry renders the same bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.core.errors import ConfigError
from pipeline.core.io import atomic_write_bytes
from pipeline.project.config import NAME_PATTERN, Registry, SkuSpec

WORKFLOW_DIR = Path(".github") / "workflows"
TEMPLATES = {"build.yml": "build.yml.j2", "promote.yml": "promote.yml.j2", "rollout.yml": "rollout.yml.j2"}
# GitHub-hosted runners for CPU SKUs that do not ask for a self-hosted one.
HOSTED = {"x86_64": "ubuntu-24.04", "aarch64": "ubuntu-24.04-arm"}


def runs_on(sku: SkuSpec) -> list[str]:
    """A SKU's runner labels when they name a self-hosted runner; a hosted runner for other CPU SKUs."""
    if "self-hosted" not in sku.runner_labels and sku.target.device == "cpu" and sku.target.arch in HOSTED:
        return [HOSTED[sku.target.arch]]
    return list(sku.runner_labels)


def matrix(registry: Registry) -> list[dict[str, Any]]:
    """One entry per SKU, in registry order: what the build job's matrix lists."""
    return [{"sku": name, "runs-on": runs_on(sku)} for name, sku in registry.skus.items()]


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
    import json

    text = json.dumps(value)
    if "${{" in text:
        raise ConfigError(
            f"registry value {value!r} holds '${{{{': GitHub would evaluate it as an expression",
            hint="rename it in params.yaml (see the name rule in docs/registry.md)",
        )
    return _Serialized(text)


def workflows(registry: Registry) -> dict[str, str]:
    """File name -> rendered text of every workflow the registry describes."""
    env = _environment()
    env.filters["yaml_value"] = yaml_value
    release = registry.release
    context = {
        "matrix": matrix(registry),
        "models": sorted(registry.models),
        "aliases": list(release.aliases),
        "skus": list(registry.skus),
        # the rollout workflow checks a dispatched model name with the registry's own rule
        "model_rule": f"^{NAME_PATTERN.pattern}$",
    }
    return {name: env.get_template(template).render(**context) for name, template in TEMPLATES.items()}


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
    for name, text in workflows(registry).items():
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
