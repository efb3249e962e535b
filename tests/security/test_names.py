"""Hostile names and paths in the registry: shell words, workflow values, paths out of the project.

Each case runs the real ``skuforge`` and asserts the exit code, a message naming the culprit with a
hint, no traceback, and that nothing was written outside the project (no ``pwned`` file anywhere).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import models
import pytest
import yaml
from cli_helpers import REPO, assert_user_error, skuforge

from pipeline.core.errors import ConfigError, InputError
from pipeline.core.paths import inside, path_problem
from pipeline.project.config import Registry, load_registry, name_problem, parse_registry, suggest_name

INJECTION = "m$(cd ..;touch pwned)"
EXPR = re.compile(r"\$\{\{.*?\}\}", re.S)


@pytest.fixture
def sandbox(tmp_path):
    """(project root, check): ``check()`` fails if anything appeared next to the project or a ``pwned``
    file anywhere. ``tmp_path / "outside"`` is there for cases that aim at it."""
    root = tmp_path / "project"
    root.mkdir()
    (tmp_path / "outside").mkdir()
    before = set(tmp_path.iterdir())

    def check() -> None:
        assert set(tmp_path.iterdir()) == before, sorted(map(str, set(tmp_path.iterdir()) - before))
        for where in (tmp_path, REPO, Path.cwd()):
            assert not list(where.glob("pwned")) and not list(tmp_path.rglob("pwned")), where

    yield root, check
    check()


def write(
    root: Path, model_names=("m",), sku_names=("cpu",), spec: dict | None = None, sku: dict | None = None, **top
) -> Path:
    spec = spec or models.conv_bn_spec()
    models.conv_bn_model(root / spec["dir"] / spec["source"])
    return models.write_project(
        root, {n: spec for n in model_names}, {n: sku or models.ort_sku("fp32") for n in sku_names}, **top
    )


def validate(root: Path):
    return skuforge("config", "validate", cwd=root)


# --- names -------------------------------------------------------------------------------------


def test_shell_metachar_model_name_is_refused_by_validate_and_repro(sandbox):
    root, check = sandbox
    write(root, model_names=(INJECTION,))
    assert_user_error(validate(root), 2, f"models.{INJECTION!r}", "use e.g. 'm_cd_touch_pwned'")
    assert_user_error(skuforge("repro", "--model", INJECTION, "--sku", "cpu", cwd=root), 2, repr(INJECTION))
    assert_user_error(skuforge("repro", cwd=root), 2, repr(INJECTION))
    check()


def test_shell_metachar_sku_name_is_refused_by_validate_and_repro(sandbox):
    root, check = sandbox
    write(root, sku_names=(INJECTION,))
    assert_user_error(validate(root), 2, f"skus.{INJECTION!r}")
    assert_user_error(skuforge("repro", "--sku", INJECTION, cwd=root), 2, repr(INJECTION))
    assert_user_error(skuforge("repro", cwd=root), 2, repr(INJECTION))
    check()


def test_dotdot_model_name(sandbox):
    root, check = sandbox
    write(root, model_names=("../../x",))
    assert_user_error(
        validate(root),
        2,
        "models.'../../x'",
        "does not start with a lowercase letter, contains '.' '/'",
        "use e.g. 'x'",
    )
    write(root)  # a valid registry: the argument is looked up, never used as a path
    assert_user_error(skuforge("prepare", "--model", "../../x", cwd=root), 2, "unknown model '../../x'")
    assert_user_error(skuforge("build", "--model", "m", "--sku", "../x", cwd=root), 2, "unknown SKU '../x'")
    check()


@pytest.mark.parametrize("section", ["models", "skus", "examples"])
@pytest.mark.parametrize(
    "name, why, suggestion",
    [
        ("a/b", "contains '/'", "a_b"),
        ("a b", "contains ' '", "a_b"),
        ("Conv", "does not start with a lowercase letter", "conv"),
        ("x" * 65, "is 65 characters long", "x" * 64),
        ("b #c", "contains ' ' '#'", "b_c"),
        ("x\ninjected: 1", "contains '\\n' ' ' ':'", "x_injected_1"),
        ("1st", "does not start with a lowercase letter", "n_1st"),
    ],
    ids=["slash", "space", "uppercase", "too_long", "hash_comment", "newline", "digit_first"],
)
def test_bad_names(sandbox, section, name, why, suggestion):
    root, check = sandbox
    if section == "models":
        write(root, model_names=(name,))
    elif section == "skus":
        write(root, sku_names=(name,))
    else:
        write(root, examples={name: {"dir": "examples/x"}})
    assert_user_error(validate(root), 2, f"{section}.{name!r}", why, f"use e.g. {suggestion!r}")
    check()


def test_every_bad_name_is_reported_at_once(sandbox):
    root, check = sandbox
    write(root, model_names=("A", "b-c"), sku_names=("d e",))
    proc = validate(root)
    assert_user_error(proc, 2, "models.'A'", "models.'b-c'", "skus.'d e'")
    check()


def test_pair_keys_cannot_collide(sandbox):
    """'a-b' x 'c' and 'a' x 'b-c' were both build/config/a-b-c.json: one pair silently dropped."""
    root, check = sandbox
    write(root, model_names=("a", "a-b"), sku_names=("c", "b-c"))
    assert_user_error(validate(root), 2, "models.'a-b'", "skus.'b-c'")
    check()


def test_model_and_pair_config_files_cannot_collide(sandbox):
    """Valid names, same file: model 'model' x SKU 'x' and model 'x' both resolve to model-x.json."""
    root, check = sandbox
    write(root, model_names=("model", "x"), sku_names=("x",))
    assert_user_error(validate(root), 2, "models.model x skus.x", "'model-x'", "models.x")
    check()


def test_reserved_model_name(sandbox):
    root, check = sandbox
    write(root, model_names=("config",))
    assert_user_error(validate(root), 2, "models.'config'", "reserved")
    check()


@pytest.mark.parametrize("prefix", ["team prod", "a/b", "-x", "${{ secrets.X }}"])
def test_bad_name_prefix(sandbox, prefix):
    root, check = sandbox
    write(root, release={"name_prefix": prefix})
    assert_user_error(validate(root), 2, "release.name_prefix")
    check()


def test_name_rule_unit():
    assert name_problem("digits_cnn") is None and name_problem("a" * 64) is None
    assert "not a string" in name_problem(1)
    assert suggest_name("Team-Model v2") == "team_model_v2"
    for name in ("", "_a", "a-b", "A", "a.b", "é"):
        assert name_problem(name) is not None, name


# --- paths -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "key, change, why",
    [
        ("models.m.dir", {"dir": "/etc"}, "is absolute"),
        ("models.m.dir", {"dir": "../elsewhere"}, "leaves the project root"),
        ("models.m.dir", {"dir": "models/../../elsewhere"}, "leaves the project root"),
        ("models.m.source", {"source": "/etc/passwd"}, "is absolute"),
        ("models.m.source", {"source": "../../../x.onnx"}, "leaves the project root"),
        (
            "models.m.datasets.golden.path",
            {"datasets": {"golden": {"path": "../../../golden.npz"}}},
            "leaves the project root",
        ),
        ("models.m.datasets.evaluation.path", {"datasets": {"evaluation": {"path": "/tmp/eval.npz"}}}, "is absolute"),
    ],
    ids=[
        "dir_absolute",
        "dir_dotdot",
        "dir_inner_dotdot",
        "source_absolute",
        "source_dotdot",
        "dataset_dotdot",
        "dataset_absolute",
    ],
)
def test_paths_outside_the_project(sandbox, key, change, why):
    root, check = sandbox
    spec = {**models.conv_bn_spec(), **change}
    models.conv_bn_model(root / "models/conv/model.onnx")
    models.write_project(root, {"m": spec}, {"cpu": models.ort_sku("fp32")})
    assert_user_error(validate(root), 2, key, why)
    check()


def test_example_dir_outside_the_project(sandbox):
    root, check = sandbox
    write(root, examples={"ex": {"dir": "../ex"}})
    assert_user_error(validate(root), 2, "examples.ex.dir", "leaves the project root")
    check()


def test_dotdot_that_stays_inside_is_fine(sandbox):
    root, check = sandbox
    write(root, spec={**models.conv_bn_spec(), "dir": "models/x/../conv"})
    assert validate(root).returncode == 0
    check()


def test_symlink_leading_out_of_the_project(sandbox, tmp_path):
    root, check = sandbox
    outside = tmp_path / "outside"
    models.conv_bn_model(outside / "model.onnx")
    (root / "models").mkdir()
    (root / "models" / "link").symlink_to(outside, target_is_directory=True)
    models.write_project(root, {"m": models.conv_bn_spec("models/link")}, {"cpu": models.ort_sku("fp32")})
    assert_user_error(validate(root), 2, "models.m.dir", "a symlink leads out")
    assert_user_error(skuforge("prepare", "--model", "m", cwd=root), 2, "models.m.source")
    assert not (outside / "prepared").exists() and sorted(p.name for p in outside.iterdir()) == ["model.onnx"]
    check()


def test_symlink_made_after_validation_is_refused_at_use(tmp_path):
    root = tmp_path / "project"
    reg = load_registry(write(root))
    (tmp_path / "outside").mkdir()
    assert reg.model_file("m") == root / "models/conv/model.onnx"
    (root / "models/conv/model.onnx").unlink()
    (root / "models/conv/model.onnx").symlink_to(tmp_path / "outside" / "model.onnx")
    with pytest.raises(InputError, match="outside the project root"):
        reg.model_file("m")


def test_path_rule_unit(tmp_path):
    assert path_problem("models/conv") is None and path_problem("a/../b") is None and path_problem(".") is None
    assert path_problem("") == "is empty"
    assert path_problem("C:\\x") == "is absolute" and path_problem("\\\\host\\share") == "is absolute"
    assert path_problem("a\\..\\..\\b") == "leaves the project root ('..')"
    assert inside(tmp_path, "a", "b") == tmp_path / "a" / "b"
    with pytest.raises(InputError):
        inside(tmp_path / "x", "..", "y")


# --- YAML and toolchain ------------------------------------------------------------------------


def test_duplicate_top_level_key(sandbox):
    root, check = sandbox
    params = write(root)
    text = params.read_text()
    params.write_text(text + "skus: {}\n")
    line = 1 + text.splitlines().index("skus:")
    proc = validate(root)
    assert_user_error(proc, 2, "key 'skus'", f"lines {line} and {len(text.splitlines()) + 1}")
    check()


def test_duplicate_nested_key(sandbox):
    root, check = sandbox
    params = write(root)
    lines = params.read_text().splitlines()
    at = lines.index("    source: model.onnx")
    lines.insert(at + 1, "    source: other.onnx")
    params.write_text("\n".join(lines) + "\n")
    assert_user_error(validate(root), 2, "key 'models.m.source'", f"lines {at + 1} and {at + 2}")
    check()


def test_merge_keys_may_override():
    """'<<' merges are how YAML shares a block; overriding a merged key is not a duplicate."""
    from pipeline.project.config.load import _unique_key_loader

    doc = yaml.load("base: &b {x: 1, y: 2}\nother:\n  <<: *b\n  x: 3\n", Loader=_unique_key_loader())
    assert doc["other"] == {"x": 3, "y": 2}


@pytest.mark.parametrize(
    "toolchain, culprit",
    [
        ({"onnxruntime": "one point twenty"}, "'one point twenty' is not a PEP 440 version specifier"),
        ({"onnxruntime": "1.20"}, "'1.20' is not a PEP 440"),
        ({"onnx runtime": ">=1.20"}, "'onnx runtime' is not a package name"),
        ({"-ort": ">=1.20"}, "'-ort' is not a package name"),
    ],
    ids=["words", "no_operator", "space_in_package", "dash_first_package"],
)
def test_bad_toolchain(sandbox, toolchain, culprit):
    root, check = sandbox
    write(root, sku=models.ort_sku("fp32", toolchain=toolchain))
    assert_user_error(validate(root), 2, "skus.cpu.toolchain", culprit)
    # it used to pass validation, then `repro --sku` skipped the SKU and exited 0 having built nothing
    assert_user_error(skuforge("repro", "--sku", "cpu", cwd=root), 2, culprit)
    check()


# --- rendered workflows ------------------------------------------------------------------------


HOSTILE = [
    "b #c",
    "x\ninjected: true",
    "a: b",
    "'q\"",
    "[x]",
    "{y: 1}",
    "*alias",
    "&anchor",
    "- item",
    "yes",
    "null",
    "1.0",
    "%TAG",
    "@at",
    "`tick`",
    "x\r\ny: 1",
    "\u2028z",
    "|\n  block",
    "$(touch pwned)",
    "${ not_an_expr }",
]


def _registry_with(models_: list[str], skus: list[str], labels: list[str]) -> Registry:
    """Bypass the name rule (it refuses these names) to test the renderer on its own."""
    spec = parse_registry(
        {
            "defaults": {},
            "examples": {},
            "models": {"m": models.conv_bn_spec()},
            "skus": {"s": models.ort_sku(runner_labels=["self-hosted", "linux"])},
        }
    )
    sku = spec.skus["s"].model_copy(update={"runner_labels": labels})
    return Registry.model_construct(
        defaults=spec.defaults,
        examples={},
        models={n: spec.models["m"] for n in models_},
        skus={n: sku for n in skus},
        release=spec.release,
    )


def _replace(doc, mapping: dict[str, str]):
    if isinstance(doc, dict):
        return {_replace(k, mapping): _replace(v, mapping) for k, v in doc.items()}
    if isinstance(doc, list):
        return [_replace(v, mapping) for v in doc]
    return mapping.get(doc, doc) if isinstance(doc, str) else doc


def _matrix_env(doc: dict) -> dict:
    """The env of the plan job's step that holds the SKU jobs as JSON (read by jq, never pasted)."""
    (step,) = [s for s in doc["jobs"]["plan"]["steps"] if "MATRIX" in s.get("env", {})]
    return step["env"]


def _matrix_parsed(doc: dict) -> dict:
    """``doc`` with build.yml's JSON matrix parsed, so each name in it is compared as a value."""
    if "plan" in doc.get("jobs", {}):
        env = _matrix_env(doc)
        env["MATRIX"] = json.loads(env["MATRIX"])
    return doc


def test_hostile_names_render_as_literal_values():
    from pipeline.ci.render import workflows

    rank = {h: i for i, h in enumerate(sorted(HOSTILE))}
    placeholders = [f"name_{rank[h]:02d}" for h in HOSTILE]  # sorted alike: promote.yml sorts the models
    clean = workflows(_registry_with(placeholders, placeholders, ["self-hosted", *placeholders]))
    hostile = workflows(_registry_with(HOSTILE, HOSTILE, ["self-hosted", *HOSTILE]))
    back = {h: p for h, p in zip(HOSTILE, placeholders, strict=True)}
    for name, text in hostile.items():
        doc = _matrix_parsed(yaml.safe_load(text))
        # the same document as with harmless names: no key added, every value a whole literal string
        assert _replace(doc, back) == _matrix_parsed(yaml.safe_load(clean[name])), name
        for expr in EXPR.findall(text):
            assert not any(h in expr for h in HOSTILE), expr
    build = _matrix_parsed(yaml.safe_load(hostile["build.yml"]))
    assert [e["sku"] for e in _matrix_env(build)["MATRIX"]] == HOSTILE
    for step in build["jobs"]["sku"]["steps"]:  # scripts read the SKU from env, never pasted text
        assert not any(h in step.get("run", "") for h in HOSTILE if len(h) > 3 and not h.isalnum()), step
    promote = yaml.safe_load(hostile["promote.yml"])
    assert promote[True]["workflow_dispatch"]["inputs"]["model"]["options"] == sorted(HOSTILE)


@pytest.mark.parametrize("where", ["models", "skus", "labels"])
def test_github_expression_in_a_name_is_refused_by_the_renderer(where):
    from pipeline.ci.render import workflows

    bad = "${{ github.token }}"
    reg = _registry_with(
        [bad] if where == "models" else ["m"],
        [bad] if where == "skus" else ["s"],
        ["self-hosted", bad] if where == "labels" else ["self-hosted"],
    )
    with pytest.raises(ConfigError, match=re.escape(repr(bad))):
        workflows(reg)


def test_github_expression_in_a_sku_name_fails_validate_first(sandbox):
    root, check = sandbox
    write(root, sku_names=("${{ github.token }}",))
    assert_user_error(skuforge("ci", "render", "--check", cwd=root), 2, "skus.'${{ github.token }}'")
    assert not (root / ".github").exists()
    check()
