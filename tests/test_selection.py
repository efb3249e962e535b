"""Selection with evidence (pipeline/verify/selection.py): per (model, device class) the fastest
candidate whose gates pass, chosen only when separated from the runner-up, else a tie broken by
selection.prefer; the digest-bound record and its reader; `skuforge select` on a built project."""

from __future__ import annotations

import json
import os
from pathlib import Path

import jsonschema
import numpy as np
import pytest
from cli_helpers import assert_user_error, skuforge
from registry_helpers import fake_bench
from rollout.conftest import classed_copy

from pipeline.core.errors import ConfigError, InputError
from pipeline.core.io import read_json
from pipeline.core.paths import Layout
from pipeline.project.config import SelectionSpec, load_registry, parse_registry
from pipeline.results.outcomes import outcome_path, record_outcome
from pipeline.results.selection import (
    SCHEMA_FILE,
    SelectionCandidate,
    SelectionRecord,
    schema,
    sealed,
    validate_document,
)
from pipeline.verify.selection import decide, read_selection, rule_text

SPEC = SelectionSpec()
REPO_SCHEMA = Path(__file__).resolve().parents[1] / "pipeline" / "schemas"


def samples(p50: float, spread: float, n: int = 200, seed: int = 0) -> list[float]:
    """Steady-state latencies around ``p50`` ms, as latency.csv holds them (4 decimals)."""
    rng = np.random.default_rng(seed)
    return [round(float(x), 4) for x in rng.normal(p50, spread, n).clip(p50 * 0.5)]


def candidate(sku: str, backend: str, drawn: list[float] | None, passed: bool = True, **extra) -> SelectionCandidate:
    """A candidate as weigh() makes it from a manifest and its bench samples."""
    fields = {
        "sku": sku,
        "backend": backend,
        "precision": "int8",
        "manifest_digest": f"{sku:0<64}"[:64],
        "outcome": "passed" if passed else "gate failed",
        "eligible": passed,
        "reason": "" if passed else "gate failed: output probs: 12.50% of elements beyond atol=0.01",
        "value": float(np.percentile(drawn, 50)) if drawn else None,
        "evidence": "samples" if drawn else None,
        "samples": len(drawn) if drawn else None,
        "host": "Test CPU",
    }
    return SelectionCandidate.model_validate({**fields, **extra})


def test_a_clear_winner_is_chosen_separated():
    fast, slow = samples(1.0, 0.02), samples(1.4, 0.03, seed=1)
    cands = [candidate("x86_ort_int8", "onnxruntime", slow), candidate("x86_ov_int8", "openvino", fast)]
    choice = decide("x86-avx2", cands, {"x86_ort_int8": slow, "x86_ov_int8": fast}, SPEC)
    assert choice.decision == "separated" and choice.chosen == "x86_ov_int8" and choice.runner_up == "x86_ort_int8"
    m = choice.margin
    assert m is not None and m.separated and m.interval is not None
    assert 1.0 < m.interval[0] <= m.ratio <= m.interval[1] and m.ratio == pytest.approx(1.4, rel=0.05)
    assert "bootstrap" in m.method and "200 and 200" in m.method
    assert choice.summary.startswith("x86_ov_int8 selected for x86-avx2 (1.4x over runner-up x86_ort_int8")
    assert choice.summary.endswith("separated)") and choice.rule == rule_text(SPEC) and not choice.tied


def test_overlapping_intervals_are_a_tie_broken_by_preference():
    ov, ort = samples(1.00, 0.10), samples(1.01, 0.10, seed=1)  # openvino a hair faster, within noise
    cands = [candidate("x86_ov_int8", "openvino", ov), candidate("x86_ort_int8", "onnxruntime", ort)]
    choice = decide("x86-avx2", cands, {"x86_ov_int8": ov, "x86_ort_int8": ort}, SPEC)
    assert choice.decision == "tie" and choice.tied == ["x86_ov_int8", "x86_ort_int8"]
    assert choice.chosen == "x86_ort_int8" and choice.runner_up == "x86_ov_int8"  # onnxruntime first in prefer
    assert choice.margin is not None and not choice.margin.separated
    assert choice.margin.interval is not None and choice.margin.interval[0] <= 1.0 <= choice.margin.interval[1]
    assert "tie with x86_ov_int8, not separated" in choice.summary
    assert "onnxruntime first in selection.prefer" in choice.summary
    # another preference order picks the other one, still said as a tie
    other = decide(
        "x86-avx2", cands, {"x86_ov_int8": ov, "x86_ort_int8": ort}, SelectionSpec(prefer=["openvino", "onnxruntime"])
    )
    assert other.decision == "tie" and other.chosen == "x86_ov_int8" and other.runner_up == "x86_ort_int8"


def test_a_winner_that_fails_its_gate_gives_way_to_the_next_passing_one():
    fastest, mid, slow = samples(0.5, 0.01), samples(1.0, 0.02, seed=1), samples(2.0, 0.04, seed=2)
    cands = [
        candidate("x86_litert_int8", "litert", fastest, passed=False),
        candidate("x86_ov_int8", "openvino", mid),
        candidate("x86_tvm_fp32", "tvm", slow),
    ]
    drawn = {"x86_litert_int8": fastest, "x86_ov_int8": mid, "x86_tvm_fp32": slow}
    choice = decide("x86-avx2", cands, drawn, SPEC)
    assert choice.decision == "separated" and choice.chosen == "x86_ov_int8" and choice.runner_up == "x86_tvm_fp32"
    failed = next(c for c in choice.candidates if c.sku == "x86_litert_int8")
    assert not failed.eligible and failed.reason.startswith("gate failed")
    # every candidate failing: none, each with its reason
    none = decide("x86-avx2", [cands[0]], drawn, SPEC)
    assert none.decision == "none passed" and none.chosen is None
    assert "no candidate passed (x86_litert_int8: gate failed: output probs" in none.summary
    # under DVC a failed validate leaves no manifest: still none passed, with the matrix's reason
    unbuilt = failed.model_copy(update={"manifest_digest": None, "reason": "no manifest (gate failed: output probs)"})
    assert decide("x86-avx2", [unbuilt], {}, SPEC).decision == "none passed"


def test_a_class_with_one_candidate():
    drawn = samples(3.0, 0.1)
    cands = [
        candidate("x86_iree_vulkan_fp32", "iree", drawn),
        SelectionCandidate(
            sku="x86_iree_vulkan_fp16",
            backend="iree",
            precision="fp16",
            manifest_digest=None,
            outcome="not run",
            eligible=False,
            reason="no manifest yet",
        ),
    ]
    choice = decide("x86-vulkan", cands, {"x86_iree_vulkan_fp32": drawn}, SPEC)
    assert choice.decision == "only candidate" and choice.chosen == "x86_iree_vulkan_fp32"
    assert choice.runner_up is None and choice.margin is None
    assert choice.summary == "x86_iree_vulkan_fp32 selected for x86-vulkan (only candidate)"
    empty = decide("rpi5", cands[1:], {}, SPEC)
    assert empty.decision == "no candidates" and empty.chosen is None


def test_without_bound_samples_the_manifest_intervals_decide():
    apart = [
        candidate("a", "openvino", None, value=1.0, interval=(0.95, 1.05), evidence="intervals", confidence=0.95),
        candidate("b", "onnxruntime", None, value=1.5, interval=(1.40, 1.60), evidence="intervals", confidence=0.95),
    ]
    choice = decide("c", apart, {}, SPEC)
    assert choice.decision == "separated" and choice.chosen == "a"
    assert choice.margin is not None and choice.margin.interval == pytest.approx((1.40 / 1.05, 1.60 / 0.95))
    overlapping = [apart[0], apart[1].model_copy(update={"value": 1.08, "interval": (1.0, 1.2)})]
    tie = decide("c", overlapping, {}, SPEC)
    assert tie.decision == "tie" and tie.chosen == "b"  # onnxruntime before openvino
    # throughput: higher wins, and the ratio is the chosen one's over the runner-up's
    fast = decide("c", apart, {}, SelectionSpec(objective="throughput"))
    assert fast.chosen == "b" and fast.margin is not None and fast.margin.ratio == pytest.approx(1.5)


def test_p99_judges_the_tail():
    # ``spiky`` is faster at the median, but one call in twenty takes 3 ms: by p99 ``steady`` wins
    spiky = [3.0 if i % 20 == 0 else x for i, x in enumerate(samples(0.8, 0.01, n=400))]
    steady = samples(1.0, 0.01, n=400, seed=1)
    drawn = {"spiky": spiky, "steady": steady}
    p99 = SelectionSpec(objective="p99")
    cands = [
        candidate(name, "openvino", s, value=float(np.percentile(s, 99)), interval=None) for name, s in drawn.items()
    ]
    choice = decide("c", cands, drawn, p99)
    assert choice.decision == "separated" and choice.chosen == "steady" and choice.runner_up == "spiky"
    assert choice.margin is not None and "p99 ratio" in choice.margin.method and choice.margin.ratio > 2
    assert decide("c", [candidate(n, "openvino", s) for n, s in drawn.items()], drawn, SPEC).chosen == "spiky"


def test_too_few_samples_never_separate():
    a, b = samples(1.0, 0.01, n=10), samples(2.0, 0.01, n=10, seed=1)
    choice = decide("c", [candidate("a", "openvino", a), candidate("b", "onnxruntime", b)], {"a": a, "b": b}, SPEC)
    assert choice.decision == "tie" and choice.chosen == "b"
    assert choice.margin is not None and "too few samples" in choice.margin.method


def test_config_refuses_unknown_objectives_classes_and_backends():
    def parse(selection=None, device_class="x86-avx2"):
        doc = {
            "defaults": {},
            "examples": {},
            "models": {},
            "skus": {
                "s": {
                    "backend": "onnxruntime",
                    "precision": "fp32",
                    "device_class": device_class,
                    "target": {"arch": "x86_64", "device": "cpu", "os": "linux"},
                    "runner_labels": ["x"],
                }
            },
        }
        if selection is not None:
            doc["selection"] = selection
        return parse_registry(doc)

    reg = parse()
    assert reg.selection == SPEC and reg.selection.objective == "p50" and reg.device_classes() == {"x86-avx2": ["s"]}
    with pytest.raises(ConfigError, match=r"selection\.objective"):
        parse({"objective": "energy"})
    with pytest.raises(ConfigError, match="unknown backend 'onnxrutime'.*did you mean 'onnxruntime'"):
        parse({"prefer": ["onnxrutime"]})
    with pytest.raises(ConfigError, match=r"skus\.s\.device_class.*not a device class name.*'x86-avx2'"):
        parse(device_class="X86 AVX2")
    assert parse(device_class=None).device_classes() == {}


def test_the_schema_file_is_current_and_a_tampered_record_is_refused():
    published = json.loads((REPO_SCHEMA / SCHEMA_FILE).read_text())
    assert published == schema()
    jsonschema.validators.validator_for(published).check_schema(published)
    drawn = samples(1.0, 0.02)
    record = sealed(
        SelectionRecord(
            model="m",
            digest="",
            objective="p50",
            confidence=0.95,
            prefer=SPEC.prefer,
            manifests={"a": "a" * 64},
            classes=[decide("c", [candidate("a", "openvino", drawn)], {"a": drawn}, SPEC)],
        )
    )
    doc = record.to_json()
    assert validate_document(doc) == record
    tampered = json.loads(json.dumps(doc))
    tampered["classes"][0]["chosen"] = "b"
    with pytest.raises(InputError, match="digest does not match"):
        validate_document(tampered)
    with pytest.raises(InputError, match="does not match the selection schema"):
        validate_document({**doc, "classes": "all of them"})


# --- on a built project -------------------------------------------------------------------------


@pytest.fixture
def built(tmp_path_factory, tmp_path):
    """The rollout tests' project (conv built for ``cpu`` and ``portable``, manifests written), copied,
    both SKUs in device class x86-test, their latencies set: cpu about twice as fast."""
    root, _ = classed_copy(tmp_path_factory, tmp_path)
    reg = load_registry(root / "params.yaml")
    digests = {
        "cpu": fake_bench(reg, "conv", "cpu", samples(1.0, 0.02)),
        "portable": fake_bench(reg, "conv", "portable", samples(2.0, 0.04, seed=1)),
    }
    return reg, digests


def test_select_on_a_built_project(built):
    reg, digests = built
    root = reg.root
    proc = skuforge("select", "--model", "conv", "--json", cwd=root)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    printed = json.loads(proc.stdout)
    assert "wrote build/.selection/conv.json" in proc.stderr
    assert printed == read_json(Layout(root).selection("conv")) and printed["manifests"] == digests
    (c,) = printed["classes"]
    assert (c["device_class"], c["decision"], c["chosen"], c["runner_up"]) == (
        "x86-test",
        "separated",
        "cpu",
        "portable",
    )
    assert c["margin"]["ratio"] == pytest.approx(2.0, rel=0.05) and c["margin"]["interval"][0] > 1.0
    assert [x["evidence"] for x in c["candidates"]] == ["samples", "samples"]
    assert [x["samples"] for x in c["candidates"]] == [200, 200]
    assert read_selection(reg, "conv").digest == printed["digest"]

    text = skuforge("select", "--model", "conv", "--class", "x86-test", cwd=root)
    assert text.returncode == 0 and "cpu selected for x86-test (2x over runner-up portable" in text.stdout
    assert_user_error(skuforge("select", "--model", "conv", "--class", "x86-tset", cwd=root), 2, "did you mean")

    # a record edited by hand is refused; so is one whose manifests changed since
    path = Layout(root).selection("conv")
    doc = read_json(path)
    doc["classes"][0]["chosen"] = "portable"
    path.write_text(json.dumps(doc))
    with pytest.raises(InputError, match="digest does not match"):
        read_selection(reg, "conv")
    skuforge("select", "--model", "conv", cwd=root)
    fake_bench(reg, "conv", "portable", samples(0.5, 0.01, seed=2))
    with pytest.raises(InputError, match=r"stale: manifests/conv/portable\.json changed"):
        read_selection(reg, "conv")

    # the faster engine fails its gate after its manifest (the matrix's verdict): the other one is chosen
    record_outcome(root, "validate", "conv", "portable", 1, "output probs: 12.50% of elements beyond tolerance")
    later = Layout(root).manifest("conv", "portable").stat().st_mtime + 1
    os.utime(outcome_path(root, "validate", "conv", "portable"), (later, later))
    proc = skuforge("select", "--model", "conv", "--json", cwd=root)
    (c,) = json.loads(proc.stdout)["classes"]
    assert proc.returncode == 0 and (c["decision"], c["chosen"]) == ("only candidate", "cpu")
    assert [x["outcome"] for x in c["candidates"]] == ["passed", "gate failed"]


# --- in MLflow ----------------------------------------------------------------------------------


@pytest.mark.parametrize("store", ["server", "embedded"])
def test_the_selection_is_published_to_mlflow(built, store, request, tmp_path):
    """`skuforge select --publish`: a run in the model's experiment holding the record as
    selection.json and the choice per class as tags, once per digest; the experiment tagged with the
    current choice (a new record moves the tags, its own run beside the first)."""
    from cli_helpers import service_env

    from pipeline.tracking.client import connect, experiment_name
    from pipeline.tracking.selection import SELECTION_ARTIFACT, TAG_SELECTION_DIGEST, TAG_SELECTION_RUN

    reg, _ = built
    root = reg.root
    uri = request.getfixturevalue("server").uri if store == "server" else None
    env = service_env(**({"MLFLOW_TRACKING_URI": uri} if uri else {}))
    tracking = connect(reg, uri=uri)

    def publish() -> dict:
        proc = skuforge("select", "--model", "conv", "--json", "--publish", cwd=root, env=env, timeout=300)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "published the selection of conv" in proc.stderr, proc.stderr
        return json.loads(proc.stdout)

    record = publish()
    exp = tracking.client.get_experiment_by_name(experiment_name(reg.release, "conv"))
    runs = tracking.client.search_runs(
        [exp.experiment_id], filter_string=f"tags.`{TAG_SELECTION_DIGEST}` = '{record['digest']}'"
    )
    (run,) = runs
    tags = run.data.tags
    assert tags["skuforge.kind"] == "selection" and tags["skuforge.model"] == "conv"
    assert tags["skuforge.selection.x86-test"] == "cpu" and tags["skuforge.selection.x86-test.decision"] == "separated"
    assert tags["skuforge.selection.x86-test.runner_up"] == "portable"
    assert tags["skuforge.artifacts_complete"] == "true" and run.info.status == "FINISHED"
    assert run.data.metrics["selection.x86-test.separated"] == 1.0
    assert run.data.metrics["selection.x86-test.margin"] == pytest.approx(2.0, rel=0.05)
    local = tracking.client.download_artifacts(run.info.run_id, SELECTION_ARTIFACT, str(tmp_path))
    assert Path(local).read_bytes() == Layout(root).selection("conv").read_bytes()  # the record, byte for byte
    exp = tracking.client.get_experiment(exp.experiment_id)
    assert exp.tags[TAG_SELECTION_DIGEST] == record["digest"] and exp.tags[TAG_SELECTION_RUN] == run.info.run_id
    assert exp.tags["skuforge.selection.x86-test"] == "cpu"

    # the same record again: the same run, nothing new
    assert publish()["digest"] == record["digest"]
    assert (
        len(tracking.client.search_runs([exp.experiment_id], filter_string="tags.`skuforge.kind` = 'selection'")) == 1
    )

    # portable becomes the faster one: a new record, its own run, the experiment's tags follow it
    fake_bench(reg, "conv", "portable", samples(0.5, 0.01, seed=2))
    again = publish()
    assert again["digest"] != record["digest"] and again["classes"][0]["chosen"] == "portable"
    selection_runs = tracking.client.search_runs(
        [exp.experiment_id], filter_string="tags.`skuforge.kind` = 'selection'"
    )
    assert len(selection_runs) == 2
    exp = tracking.client.get_experiment(exp.experiment_id)
    assert exp.tags[TAG_SELECTION_DIGEST] == again["digest"] and exp.tags["skuforge.selection.x86-test"] == "portable"

    # the class renamed in params.yaml: the experiment loses the old class's tag
    params = root / "params.yaml"
    params.write_text(params.read_text().replace("device_class: x86-test", "device_class: x86-renamed"))
    renamed = publish()
    assert [c["device_class"] for c in renamed["classes"]] == ["x86-renamed"]
    exp = tracking.client.get_experiment(exp.experiment_id)
    assert exp.tags["skuforge.selection.x86-renamed"] == "portable" and "skuforge.selection.x86-test" not in exp.tags
