"""Known upstream gaps of a SKU's stack (skus.<s>.known_gaps): validated as untrusted text, said under
the matrix, next to a losing candidate of the selection and in the HTML report (escaped), and never a
verdict: outcomes, the selection record and the resolved stage config stay as they were."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import models
import numpy as np
import pytest
import yaml
from cli_helpers import skuforge
from registry_helpers import fake_bench
from rollout.conftest import classed_copy

from pipeline.core.errors import ConfigError
from pipeline.core.io import read_json
from pipeline.core.paths import Layout
from pipeline.engine.matrix import matrix
from pipeline.project.config import load_registry, parse_registry
from pipeline.report import write_site
from pipeline.stages.config import resolved

EVIL = "<script>alert('x')</script> & more"
EVIL_ESCAPED = "&lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt; &amp; more"
GAP = {"ref": "iree-org/iree#22674", "says": "generated CPU convolutions 4-6x slower than MLAS/XNNPACK (upstream)"}


def registry_with(gaps) -> dict:
    return {
        "defaults": {},
        "examples": {},
        "models": {"conv": models.conv_bn_spec()},
        "skus": {"cpu": {**models.ort_sku("fp32"), "known_gaps": gaps}},
    }


def refused(gaps) -> str:
    with pytest.raises(ConfigError) as info:
        parse_registry(registry_with(gaps))
    assert info.value.exit_code == 2
    return str(info.value)


# --- the key's rules ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "ref",
    ["iree-org/iree#22674", "https://github.com/iree-org/iree/issues/22674", "a/b.c#1", "https://github.com/o/r"],
)
def test_a_ref_is_owner_repo_number_or_a_github_address(ref):
    (gap,) = parse_registry(registry_with([{**GAP, "ref": ref}])).sku("cpu").known_gaps
    assert gap.ref == ref and gap.url.startswith("https://github.com/")
    if not ref.startswith("https://"):
        assert gap.url.endswith(f"/issues/{ref.rpartition('#')[2]}")


@pytest.mark.parametrize(
    "ref",
    [
        "iree#22674",
        "iree-org/iree",
        "iree-org/iree#0",
        "http://github.com/iree-org/iree/issues/1",
        "https://gitlab.com/o/r/issues/1",
        'https://github.com/o/r/issues/1"onmouseover=x',
        "javascript:alert(1)//github.com/o/r",
        "iree-org/iree#1 ",
    ],
)
def test_a_bad_ref_is_refused_naming_the_key_and_the_rule(ref):
    text = refused([{**GAP, "ref": ref}])
    assert "skus.cpu.known_gaps.0.ref" in text and "owner/repo#N" in text and "iree-org/iree#22674" in text


@pytest.mark.parametrize("says, words", [("two\nlines", "'\\n'"), ("bell\x07", "'\\x07'"), ("rtl \u202e", "202e")])
def test_control_characters_in_says_are_refused(says, words):
    text = refused([{**GAP, "says": says}])
    assert "skus.cpu.known_gaps.0.says" in text and "control characters" in text and words in text


def test_a_long_or_empty_says_and_unknown_keys_are_refused():
    text = refused([{**GAP, "says": "x" * 200}])
    assert "skus.cpu.known_gaps.0.says" in text and "200 characters long: at most 199" in text
    assert parse_registry(registry_with([{**GAP, "says": "x" * 199}])).sku("cpu").known_gaps[0].says == "x" * 199
    assert "skus.cpu.known_gaps.0.says: is empty" in refused([{**GAP, "says": "  "}])
    assert "valid keys here: ref, says" in refused([{**GAP, "url": "x"}])
    assert "skus.cpu.known_gaps.0.says" in refused([{"ref": GAP["ref"]}])


def test_the_checked_in_iree_cpu_skus_name_the_upstream_issue(repo_registry):
    for sku in ("x86_iree_cpu_fp32", "x86_iree_cpu_fp16"):
        assert [g.ref for g in repo_registry.sku(sku).known_gaps] == ["iree-org/iree#22674"]
    assert not repo_registry.sku("x86_ort_fp32").known_gaps


@pytest.fixture(scope="module")
def repo_registry():
    return load_registry(Path(__file__).resolve().parents[1] / "params.yaml")


def test_a_gap_reruns_no_stage():
    """The resolved per-pair config (what DVC tracks) leaves known_gaps out, as it does device_class."""
    plain = parse_registry(registry_with([]))
    noted = parse_registry(registry_with([GAP]))
    assert resolved(plain) == resolved(noted)


# --- shown, never a verdict -----------------------------------------------------------------------


def _samples(p50: float, spread: float, seed: int) -> list[float]:
    rng = np.random.default_rng(seed)
    return [float(x) for x in rng.normal(p50, spread, 200).clip(p50 * 0.5)]


@pytest.fixture
def built(tmp_path_factory, tmp_path):
    """conv built for cpu and portable (the rollout tests' shared project), both in class x86-test,
    portable the slower: the losing candidate."""
    root, doc = classed_copy(tmp_path_factory, tmp_path)
    reg = load_registry(root / "params.yaml")
    fake_bench(reg, "conv", "cpu", _samples(1.0, 0.02, 0))
    fake_bench(reg, "conv", "portable", _samples(2.0, 0.04, 1))
    return root, doc


def _with_gaps(root, doc, gaps: dict) -> None:
    doc = copy.deepcopy(doc)
    for sku, listed in gaps.items():
        doc["skus"][sku]["known_gaps"] = listed
    (root / "params.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))


def test_gaps_are_said_under_the_matrix_and_the_selection_and_change_no_verdict(built):
    root, doc = built
    before = skuforge("summary", "--json", cwd=root)
    select_before = skuforge("select", "--model", "conv", "--json", cwd=root)
    assert before.returncode == 0 and select_before.returncode == 0, before.stderr + select_before.stderr

    winner = {"ref": "o/r#1", "says": "the winner's gap, not said as slower"}
    _with_gaps(root, doc, {"portable": [GAP], "cpu": [winner]})
    after = skuforge("summary", "--json", cwd=root)
    rows = {r["sku"]: r for r in json.loads(after.stdout)}
    assert rows["portable"]["known_gaps"] == [GAP] and rows["cpu"]["known_gaps"] == [winner]
    strip = [{k: v for k, v in r.items() if k != "known_gaps"} for r in json.loads(after.stdout)]
    assert strip == [{k: v for k, v in r.items() if k != "known_gaps"} for r in json.loads(before.stdout)]

    text = skuforge("summary", cwd=root).stdout
    lines = text.splitlines()
    at = lines.index("Known gaps upstream (skus.<s>.known_gaps; they change no outcome)")
    assert lines[at + 1 : at + 3] == [f"  cpu: o/r#1: {winner['says']}", f"  portable: {GAP['ref']}: {GAP['says']}"]
    assert lines[at - 2].split()[0] == "2"  # right under the matrix's count line
    # the selection under the matrix: the losing candidate's gap under its class
    sel = lines.index(next(x for x in lines if x.startswith("Selected per device class")))
    below = [x.strip() for x in lines[sel + 2 :] if x.startswith("    ")]
    assert below == [f"portable slower upstream: {GAP['ref']}: {GAP['says']}"], text

    # `skuforge select`: under the losing candidate's row only; the record itself unchanged
    shown = skuforge("select", "--model", "conv", cwd=root)
    assert shown.returncode == 0, shown.stderr
    table = shown.stdout.splitlines()
    loser = next(i for i, x in enumerate(table) if x.split()[:1] == ["portable"])
    assert table[loser + 1].strip() == f"slower upstream: {GAP['ref']}: {GAP['says']}"
    assert "the winner's gap" not in shown.stdout
    select_after = skuforge("select", "--model", "conv", "--json", cwd=root)
    assert json.loads(select_after.stdout) == json.loads(select_before.stdout)
    assert read_json(Layout(root).selection("conv"))["digest"] == json.loads(select_before.stdout)["digest"]


def test_the_report_shows_gaps_escaped_and_linked(built):
    root, doc = built
    evil = {"ref": "https://github.com/o/r/issues/7", "says": EVIL}
    _with_gaps(root, doc, {"portable": [evil]})
    reg = load_registry(root / "params.yaml")
    assert {r.sku: r.outcome for r in matrix(reg)} == {"cpu": "passed", "portable": "passed"}
    index = write_site(reg)
    for page in (index, index.parent / "conv" / "index.html"):
        html = page.read_text(encoding="utf-8")
        assert "<script" not in html and EVIL_ESCAPED in html, page
        assert '<a href="https://github.com/o/r/issues/7">https://github.com/o/r/issues/7</a>' in html
    model_page = (index.parent / "conv" / "index.html").read_text(encoding="utf-8")
    assert "portable slower upstream: " in model_page and "known gap upstream (no outcome changed)" in index.read_text()
