"""The environment variables: declared once in pipeline/core/env.py, parsed strictly, documented in
docs/cli.md from the declarations, and read nowhere else."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from pipeline.backends import caches
from pipeline.core import env
from pipeline.core.env import (
    BEGIN,
    END,
    VARIABLES,
    Flag,
    Folder,
    Integer,
    Number,
    Text,
    markdown,
    replace_table,
)
from pipeline.core.errors import ConfigError
from pipeline.core.redact import is_secret_name, redact
from pipeline.results.signing import key_dir
from pipeline.rollout.store import store_url
from pipeline.tracking.client import actor
from pipeline.tracking.publish import ci_tags

ROOT = Path(__file__).resolve().parents[1]
CLI_DOC = ROOT / "docs" / "cli.md"
REGENERATE = "python -m pipeline.core.env --write docs/cli.md"


# --- the generated table ------------------------------------------------------------------------


def _documented_table(text: str) -> str:
    start, end = text.find(BEGIN), text.find(END)
    assert start >= 0 and end > start, f"docs/cli.md has no {BEGIN!r} ... {END!r} block: run `{REGENERATE}`"
    return text[start + len(BEGIN) : end].strip("\n") + "\n"


def test_the_table_in_docs_cli_is_the_generated_one():
    documented = _documented_table(CLI_DOC.read_text(encoding="utf-8"))
    assert documented == markdown(), (
        f"docs/cli.md's environment variable table differs from pipeline/core/env.py's declarations: "
        f"run `{REGENERATE}` and commit docs/cli.md"
    )


def test_the_table_lists_every_variable_once():
    rows = [line for line in markdown().splitlines() if line.startswith("| `")]
    names = [re.match(r"\| `([A-Z0-9_]+)`", row).group(1) for row in rows]
    assert names == list(VARIABLES)


def test_write_rewrites_only_the_block(tmp_path):
    page = tmp_path / "cli.md"
    page.write_text(f"# before\n\n{BEGIN}\n| stale |\n{END}\n\nafter\n", encoding="utf-8")
    done = subprocess.run(
        [sys.executable, "-m", "pipeline.core.env", "--write", str(page)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert page.read_text(encoding="utf-8") == f"# before\n\n{BEGIN}\n{markdown()}{END}\n\nafter\n"
    shown = subprocess.run(
        [sys.executable, "-m", "pipeline.core.env", "--markdown"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert shown.returncode == 0 and shown.stdout == markdown()


def test_a_page_without_the_markers_is_refused():
    with pytest.raises(ValueError, match="block"):
        replace_table("# no table here\n")


# --- the declarations ---------------------------------------------------------------------------


def test_each_declaration_is_named_as_its_variable():
    for name, var in VARIABLES.items():
        assert getattr(env, name) is var, f"{name} is declared under another name"
        assert re.fullmatch(r"[A-Z][A-Z0-9_]*", name)


def test_each_doc_is_one_line():
    for var in VARIABLES.values():
        assert var.doc and "\n" not in var.doc and var.doc == var.doc.strip(), var.name
        assert var.owner


def test_own_variables_are_prefixed_and_external_ones_are_not():
    for var in VARIABLES.values():
        assert var.name.startswith("SKUFORGE_") == (not var.external), var.name


def test_secrets_are_masked_by_redaction():
    secrets = [var for var in VARIABLES.values() if var.secret]
    assert env.SKUFORGE_SIGNING_KEY in secrets and env.MLFLOW_TRACKING_PASSWORD in secrets
    for var in secrets:
        assert is_secret_name(var.name), f"{var.name} is secret but pipeline/core/redact.py would print it"
        assert redact(f"key: s3cr3t-value-{var.name}", {var.name: f"s3cr3t-value-{var.name}"}) == "key: ***"


def test_every_skuforge_variable_the_docs_name_is_declared():
    sources = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "pipeline" / "ci").rglob("*.j2")]
    named = {m for path in sources for m in re.findall(r"\bSKUFORGE_[A-Z0-9_]*[A-Z0-9]\b", path.read_text())}
    assert named, "no SKUFORGE_ variable found in the docs: the scan is broken"
    # not read by skuforge: the repository's GitHub secrets and variables the workflows name
    # (`secrets.X`, `vars.X`), and scripts/setup.sh's own switches; each is documented in docs/ci.md
    templates = "".join(path.read_text() for path in (ROOT / "pipeline" / "ci" / "templates").glob("*.j2"))
    settings = set(re.findall(r"\b(?:secrets|vars)\.(SKUFORGE_[A-Z0-9_]+)", templates))
    settings |= set(re.findall(r"\$\{?(SKUFORGE_[A-Z0-9_]+)", (ROOT / "scripts" / "setup.sh").read_text()))
    settings -= set(VARIABLES)
    ci_doc = (ROOT / "docs" / "ci.md").read_text()
    assert not [s for s in settings if s not in ci_doc], "a workflow or setup setting docs/ci.md does not explain"
    undeclared = named - set(VARIABLES) - settings
    assert not undeclared, f"named in the docs but not declared: {sorted(undeclared)}"


# the LiteRT converter's script runs in its own environment and imports nothing of skuforge's: its
# conversion server gives each forked conversion the environment skuforge sent (server.serve)
_OWN_PROGRAMS = {Path(env.__file__).resolve(), ROOT / "pipeline" / "backends" / "litert_converter" / "server.py"}


def _project_sources() -> list[Path]:
    return [p for p in sorted((ROOT / "pipeline").rglob("*.py")) if p.resolve() not in _OWN_PROGRAMS]


def test_every_declared_variable_is_read_somewhere():
    used: set[str] = set()
    for path in _project_sources():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.alias) and node.name in VARIABLES:
                used.add(node.name)
            elif isinstance(node, ast.Attribute) and node.attr in VARIABLES:
                used.add(node.attr)
    assert set(VARIABLES) <= used, f"declared but never used in pipeline/: {sorted(set(VARIABLES) - used)}"


_OS_ENVIRONMENT = {"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"}


def test_no_module_but_env_touches_os_environ():
    """Reads and writes go through a declaration; copies of the whole environment through
    ``process_environment()``."""
    found = []
    for path in _project_sources():
        rel = path.relative_to(ROOT)
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Attribute) and node.attr in _OS_ENVIRONMENT:
                if isinstance(node.value, ast.Name) and node.value.id == "os":
                    found.append(f"{rel}:{node.lineno}: os.{node.attr}")
            elif isinstance(node, ast.ImportFrom) and node.module == "os":
                found += [
                    f"{rel}:{node.lineno}: from os import {a.name}" for a in node.names if a.name in _OS_ENVIRONMENT
                ]
    assert not found, "use pipeline/core/env.py's declarations instead:\n" + "\n".join(found)


# --- parsing --------------------------------------------------------------------------------------

FLAG = Flag("SKUFORGE_TEST_FLAG", "a test flag")
COUNT = Integer("SKUFORGE_TEST_COUNT", "a test count", minimum=1)
RATIO = Number("SKUFORGE_TEST_RATIO", "a test ratio", default=0.5)
FOLDER = Folder("SKUFORGE_TEST_DIR", "a test folder")
WORD = Text("SKUFORGE_TEST_WORD", "a test word", default="fallback")


@pytest.mark.parametrize("text", ["1", "true", "TRUE", "True", "yes", "Yes", "on", "ON", " 1 ", "true\n"])
def test_true_spellings(text):
    assert FLAG.get({FLAG.name: text}) is True


@pytest.mark.parametrize("text", ["0", "false", "FALSE", "no", "No", "off", "Off", " 0 "])
def test_false_spellings(text):
    assert FLAG.get({FLAG.name: text}) is False


@pytest.mark.parametrize("environ", [{}, {"SKUFORGE_TEST_FLAG": ""}, {"SKUFORGE_TEST_FLAG": "  "}])
def test_an_unset_or_blank_flag_is_its_default(environ):
    assert FLAG.get(environ) is False
    assert Flag("SKUFORGE_TEST_FLAG", "on by default", default=True).get(environ) is True


@pytest.mark.parametrize("text", ["maybe", "2", "y", "enabled", "t r u e"])
def test_a_malformed_flag_is_a_config_error_naming_the_variable(text):
    with pytest.raises(ConfigError) as info:
        FLAG.get({FLAG.name: text})
    assert info.value.exit_code == 2
    message = str(info.value)
    assert FLAG.name in message and repr(text) in message and "a boolean" in message and "hint" in message


def test_integers():
    assert COUNT.get({COUNT.name: "12"}) == 12
    assert COUNT.get({COUNT.name: " 7\n"}) == 7
    assert COUNT.get({}) is None and COUNT.get({COUNT.name: ""}) is None
    assert Integer("SKUFORGE_TEST_N", "n", default=3).get({}) == 3


@pytest.mark.parametrize("text", ["abc", "1.5", "1e3", "12abc", "0x10"])
def test_a_non_integer_is_a_config_error(text):
    with pytest.raises(ConfigError, match=rf"{COUNT.name}='{re.escape(text)}' is not an integer"):
        COUNT.get({COUNT.name: text})


def test_an_integer_below_its_minimum_is_a_config_error():
    with pytest.raises(ConfigError, match="the least is 1"):
        COUNT.get({COUNT.name: "0"})


def test_numbers():
    assert RATIO.get({RATIO.name: "0.25"}) == 0.25
    assert RATIO.get({RATIO.name: "2"}) == 2.0
    assert RATIO.get({}) == 0.5
    for text in ("nan", "inf", "-inf", "half"):
        with pytest.raises(ConfigError, match=f"{RATIO.name}.* is not a finite number"):
            RATIO.get({RATIO.name: text})


def test_paths(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert FOLDER.get({FOLDER.name: "~/keys"}) == tmp_path / "keys"
    assert FOLDER.get({FOLDER.name: "/abs/dir with space"}) == Path("/abs/dir with space")
    assert FOLDER.get({FOLDER.name: "relative/dir"}) == Path("relative/dir")
    assert FOLDER.get({}) is None and FOLDER.get({FOLDER.name: ""}) is None
    with pytest.raises(ConfigError, match="NUL"):
        FOLDER.get({FOLDER.name: "a\0b"})


def test_text_keeps_an_empty_value():
    assert WORD.get({WORD.name: ""}) == ""  # SKUFORGE_FAKE_CPU_FLAGS="" fakes a CPU without flags
    assert WORD.get({WORD.name: " x "}) == " x "
    assert WORD.get({}) == "fallback"


def test_a_secret_value_is_never_in_the_message():
    secret = Integer("SKUFORGE_TEST_SECRET_KEY", "a secret number", secret=True)
    with pytest.raises(ConfigError) as info:
        secret.get({secret.name: "hunter2-very-secret"})
    assert "hunter2" not in str(info.value) and secret.name in str(info.value)


def test_accessors_read_the_live_environment(monkeypatch):
    monkeypatch.setenv(FLAG.name, "yes")
    assert FLAG.get() is True and FLAG.is_set() and FLAG.raw() == "yes"
    monkeypatch.delenv(FLAG.name)
    assert FLAG.get() is False and not FLAG.is_set() and FLAG.raw() is None


def test_set_setdefault_unset():
    environ: dict[str, str] = {}
    assert WORD.setdefault("first", environ) == "first"
    assert WORD.setdefault("second", environ) == "first"  # the value already set wins
    WORD.set("third", environ)
    assert environ == {WORD.name: "third"}
    WORD.unset(environ)
    WORD.unset(environ)  # unsetting twice is fine
    assert environ == {}


def test_declared_looks_variables_up_by_name():
    assert env.declared("SKUFORGE_STORE") is env.SKUFORGE_STORE
    with pytest.raises(KeyError):
        env.declared("SKUFORGE_NOT_A_VARIABLE")


# --- the callers keep their behaviour -----------------------------------------------------------


def test_the_cache_flag_refuses_a_malformed_value(monkeypatch):
    monkeypatch.setenv(caches.REQUIRE_ENV, "maybe")
    with pytest.raises(ConfigError, match="SKUFORGE_REQUIRE_CACHE='maybe'"):
        caches.required_by_env()
    monkeypatch.setenv(caches.REQUIRE_ENV, "on")
    assert caches.required_by_env() is True


def test_key_dir_and_store_url_read_the_given_mapping(tmp_path):
    assert key_dir({"SKUFORGE_KEY_DIR": str(tmp_path)}) == tmp_path
    assert key_dir({"XDG_CONFIG_HOME": str(tmp_path)}) == tmp_path / "skuforge"
    assert key_dir({"SKUFORGE_KEY_DIR": "", "XDG_CONFIG_HOME": ""}) == Path.home() / ".config" / "skuforge"
    assert store_url("configured", {}) == "configured"
    assert store_url("configured", {"SKUFORGE_STORE": ""}) == "configured"
    assert store_url("configured", {"SKUFORGE_STORE": "s3://b/p"}) == "s3://b/p"


def test_the_actor_and_the_ci_run_url_come_from_the_given_mapping():
    assert actor({"GITHUB_ACTOR": "octocat"}) == "octocat"
    m = SimpleNamespace(provenance=SimpleNamespace(host="box", git_commit=None))
    github = {"GITHUB_RUN_ID": "7", "GITHUB_REPOSITORY": "o/r", "GITHUB_RUN_ATTEMPT": "2", "RUNNER_NAME": "r1"}
    assert ci_tags(m, github) == {
        "skuforge.runner": "r1",
        "skuforge.ci_run_url": "https://github.com/o/r/actions/runs/7/attempts/2",
    }
    assert ci_tags(m, {"BUILD_URL": "http://jenkins/job/1"}) == {
        "skuforge.runner": "box",
        "skuforge.ci_run_url": "http://jenkins/job/1",
    }
