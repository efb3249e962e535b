"""The cache policy (pipeline.backends.caches) without TVM or TensorRT: a fake backend with a timing cache.

``FakeCacheBackend`` is ONNX Runtime (a real engine is built) that also keeps one cache file,
``decisions.bin``: it replays the file when the session trusts it (a hit) and writes it otherwise.
Its key is ``COMPILER_VERSION`` (the tests change it to make a cache stale) and a fixed target.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import models
import pytest

from pipeline import backends as backends_pkg
from pipeline.backends import caches, get_backend
from pipeline.backends.onnxruntime import OnnxRuntimeBackend
from pipeline.cli import main
from pipeline.core.errors import GateFailed, InputError
from pipeline.core.io import read_json, sha256_file
from pipeline.core.paths import Layout
from pipeline.engine.matrix import matrix
from pipeline.ops import caches as cache_commands
from pipeline.project.config import load_registry
from pipeline.report.common import status_class
from pipeline.results.manifest import digest as manifest_digest
from pipeline.results.reports import BuildReport
from pipeline.stages.build import build
from pipeline.stages.data import make_data
from pipeline.stages.prepare import prepare
from pipeline.stages.reference import reference

REPO = Path(__file__).resolve().parents[1]
COMPILER_VERSION = "1.0"  # the fake compiler's version: part of the cache key (tests monkeypatch it)
TARGET = "test-target"
MAGIC = b"DEC1"
CACHE_FILE = "decisions.bin"
REFRESH_REASON = "a refresh was asked for"
SEEN: list[dict[str, Path | None]] = []  # what each fake build was handed by ``CacheSession.file``


def decisions() -> bytes:
    """What the fake compiler decides: depends on its version, like a real tuning database."""
    return MAGIC + f" decisions of compiler {COMPILER_VERSION}\n".encode()


class FakeCacheBackend(OnnxRuntimeBackend):
    name = "fakecache"
    capabilities = dataclasses.replace(OnnxRuntimeBackend.capabilities, cache="timing-cache")
    cache_files = (CACHE_FILE,)

    def cache_key(self, sku):
        return {"compiler": COMPILER_VERSION, "target": TARGET}

    def check_cache(self, folder: Path):
        data = (folder / CACHE_FILE).read_bytes() if (folder / CACHE_FILE).is_file() else b""
        return None if data.startswith(MAGIC) else f"{CACHE_FILE} is not a DEC1 decisions file"

    def _build_impl(self, ctx, staged):
        outcome = super()._build_impl(ctx, staged)
        SEEN.append({name: staged.cache.file(name) for name in self.cache_files})
        if staged.cache.file(CACHE_FILE) is not None:
            staged.cache.hit()
        else:
            staged.cache.write(CACHE_FILE, decisions(), trials=3)
        return outcome


SKUS = {
    "fake": {**models.ort_sku("fp32"), "backend": "fakecache"},
    "strict": {**models.ort_sku("fp32"), "backend": "fakecache", "cache": {"require": True}},
    "plain": models.ort_sku("fp32"),  # onnxruntime keeps no cache
}


@pytest.fixture(scope="module", autouse=True)
def fake_backend():
    """Register the fake backend before any registry is loaded (config checks SKUs against it)."""
    with (
        pytest.MonkeyPatch.context() as mp,
        backends_pkg.registered_backend("fakecache", f"{__name__}:FakeCacheBackend"),
    ):
        mp.delenv(caches.REQUIRE_ENV, raising=False)
        yield


@pytest.fixture(scope="module")
def base(tmp_path_factory, fake_backend) -> Path:
    """A project with the conv model prepared, its data and reference made: nothing built."""
    root = tmp_path_factory.mktemp("cache-base")
    models.conv_bn_model(root / "models/conv/model.onnx")
    reg = load_registry(models.write_project(root, {"conv": models.conv_bn_spec()}, SKUS))
    prepare(reg, "conv")
    make_data(reg, "conv")
    reference(reg, "conv")
    return root


@pytest.fixture
def proj(base, tmp_path, monkeypatch):
    """This test's own copy of the base project."""
    monkeypatch.delenv(caches.REQUIRE_ENV, raising=False)
    root = tmp_path / "project"
    shutil.copytree(base, root)
    reg = load_registry(root / "params.yaml")
    out = Layout(reg.root)
    return SimpleNamespace(
        registry=reg,
        root=root,
        out=out,
        params=root / "params.yaml",
        cache=lambda sku="fake": out.cache_dir("conv", sku),
        engine=lambda sku="fake": out.engine_dir("conv", sku),
        report=lambda sku="fake": out.report("conv", sku, "build"),
    )


def index(folder: Path) -> dict:
    return read_json(folder / caches.INDEX)


def tree(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` with its bytes (empty when the folder is absent)."""
    if not folder.exists():
        return {}
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def status_of(registry, sku: str = "fake") -> caches.CacheStatus:
    rows = cache_commands.status(registry, [sku], ["conv"])
    assert len(rows) == 1, rows
    return rows[0]


# --- 1, 2: the first build writes the cache, the second replays it ---------------------------------


def test_first_build_writes_the_cache_and_its_index(proj):
    report = build(proj.registry.pair("conv", "fake"))
    rec = report.cache
    assert rec is not None
    assert (rec.kind, rec.state, rec.reason) == ("timing-cache", "missing", "no cache yet")
    assert rec.misses >= 1 and rec.hits == 0 and rec.hit_rate == 0
    assert rec.updated is True and rec.required is False
    assert rec.key == {"compiler": "1.0", "target": TARGET}
    # a missing cache is expected on a first build: no warning about it
    assert not any("not used" in w for w in report.warnings), report.warnings

    folder = proj.cache()
    assert folder == proj.root / "caches" / "fake" / "conv"
    assert (folder / CACHE_FILE).read_bytes() == decisions()
    doc = index(folder)
    assert doc["backend"] == "fakecache" and doc["kind"] == "timing-cache"
    assert doc["key"] == FakeCacheBackend().cache_key(proj.registry.sku("fake"))
    assert doc["files"] == [{"path": CACHE_FILE, "sha256": sha256_file(folder / CACHE_FILE), "bytes": len(decisions())}]
    assert doc["tuned_at"] and doc["tuned_at"].endswith("Z")
    assert doc["trials"] == 3
    # the build report and the engine's metadata carry the same record
    assert read_json(proj.report())["cache"] == rec.model_dump(mode="json")
    assert read_json(proj.engine() / "engine.json")["cache"]["sha256"] == rec.sha256
    assert status_of(proj.registry).state == "fresh"


def test_second_build_replays_the_cache_and_leaves_it_untouched(proj):
    build(proj.registry.pair("conv", "fake"))
    before = tree(proj.cache())
    report = build(proj.registry.pair("conv", "fake"))
    assert SEEN[-1] == {CACHE_FILE: proj.cache() / CACHE_FILE}  # the trusted file is replayed
    rec = report.cache
    assert (rec.state, rec.reason) == ("fresh", "key and files match")
    assert (rec.hits, rec.misses, rec.hit_rate, rec.updated) == (1, 0, 1.0, False)
    assert rec.missed == []
    assert tree(proj.cache()) == before  # cache.json byte for byte: no diff for git
    assert not any("not used" in w for w in report.warnings), report.warnings
    row = status_of(proj.registry)
    assert row.state == "fresh" and row.last_build["hits"] == 1 and row.last_build["state"] == "fresh"


# --- 3, 4, 5: stale and corrupt caches are reported, never read, and left as they are ------------------


def listing(folder: Path) -> dict[str, bytes | str]:
    """Every entry under ``folder`` without following a link: a file's bytes, ``-> target`` for a link."""
    out: dict[str, bytes | str] = {}
    for top, dirs, names in os.walk(folder):
        for name in dirs + names:
            path = Path(top, name)
            rel = path.relative_to(folder).as_posix()
            if path.is_symlink():
                out[rel] = f"-> {os.readlink(path)}"
            elif path.is_file():
                out[rel] = path.read_bytes()
    return out


def assert_unused_and_kept(proj, state: str, *words: str, refresh: bool = False) -> BuildReport:
    """cache status and the build both say ``state``, naming ``words``; the build reads nothing from
    the folder, records that the engine was built without it, and removes or rewrites nothing;
    ``refresh``: then ``cache refresh`` rebuilds it."""
    row = status_of(proj.registry)
    assert (row.state, row.foreign) == (state, False), (row.state, row.reason)
    for word in words:
        assert word in row.reason, (word, row.reason)
    before = listing(proj.cache())
    report = build(proj.registry.pair("conv", "fake"))
    assert SEEN[-1] == {CACHE_FILE: None}, f"a {state} cache was read"
    rec = report.cache
    assert rec.state == state and rec.hits == 0 and rec.misses >= 1
    assert (rec.updated, rec.files, rec.sha256) == (False, [], None)
    assert rec.unused() == f"cache: {state} — built without checked-in timing cache"
    [warning] = [w for w in report.warnings if f"is {state}" in w]
    assert "not used" in warning and "left as it is" in warning, warning
    assert "skuforge cache refresh --sku fake --model conv" in warning, warning
    assert listing(proj.cache()) == before, "a build changed a cache it did not trust"
    if refresh:
        assert cache_commands.refresh(proj.registry, "fake", ["conv"])[0]["updated"] is True
        assert (proj.cache() / CACHE_FILE).read_bytes() == decisions()
        assert index(proj.cache())["files"][0]["sha256"] == sha256_file(proj.cache() / CACHE_FILE)
        assert status_of(proj.registry).state == "fresh"
    return report


def test_a_cache_of_another_compiler_version_is_stale_and_left_as_it_is(proj, monkeypatch):
    build(proj.registry.pair("conv", "fake"))
    old_trials = index(proj.cache())["trials"]
    monkeypatch.setattr(f"{__name__}.COMPILER_VERSION", "2.0")
    report = assert_unused_and_kept(proj, "stale", "compiler", "'1.0'", "'2.0'")
    assert "target" not in report.cache.reason  # only what differs is named
    assert index(proj.cache())["key"] == {"compiler": "1.0", "target": TARGET}

    cache_commands.refresh(proj.registry, "fake", ["conv"])  # what rewrites it: a person's refresh
    doc = index(proj.cache())
    assert doc["key"] == {"compiler": "2.0", "target": TARGET}
    assert (proj.cache() / CACHE_FILE).read_bytes() == decisions()  # the 2.0 decisions
    assert doc["trials"] == 3 == old_trials  # the old trials made nothing that is kept
    assert build(proj.registry.pair("conv", "fake")).cache.state == "fresh"


def test_a_cache_made_by_another_backend_is_stale(proj):
    build(proj.registry.pair("conv", "fake"))
    doc = index(proj.cache())
    (proj.cache() / caches.INDEX).write_text(json.dumps({**doc, "backend": "tensorrt"}))
    assert_unused_and_kept(proj, "stale", "tensorrt", "fakecache")


def test_an_edited_cache_file_is_corrupt_and_left_as_it_is(proj):
    build(proj.registry.pair("conv", "fake"))
    (proj.cache() / CACHE_FILE).write_bytes(MAGIC + b" edited by hand\n")
    assert_unused_and_kept(proj, "corrupt", CACHE_FILE, "sha256", refresh=True)


def test_a_truncated_cache_file_is_corrupt(proj, capsys):
    build(proj.registry.pair("conv", "fake"))
    path = proj.cache() / CACHE_FILE
    path.write_bytes(path.read_bytes()[:-3])
    assert_unused_and_kept(proj, "corrupt", CACHE_FILE)
    # the build command says it, not only build.json
    code, out, err = cli(capsys, "--params", str(proj.params), "build", "--model", "conv", "--sku", "fake")
    assert code == 0, err
    built, said = out.splitlines()
    assert built.startswith("built conv/fake in ")
    assert said.startswith(f"cache: corrupt — built without checked-in timing cache ({CACHE_FILE} differs"), said
    assert said.endswith("rebuild it: skuforge cache refresh --sku fake --model conv, then commit caches/fake/conv")


def test_a_listed_cache_file_that_is_gone_is_corrupt(proj):
    build(proj.registry.pair("conv", "fake"))
    (proj.cache() / CACHE_FILE).unlink()
    assert_unused_and_kept(proj, "corrupt", CACHE_FILE, "missing")
    assert not (proj.cache() / CACHE_FILE).exists()


def test_a_file_the_index_vouches_for_but_the_backend_cannot_read_is_corrupt(proj):
    build(proj.registry.pair("conv", "fake"))
    path = proj.cache() / CACHE_FILE
    path.write_bytes(b"XXXX not decisions\n")
    doc = index(proj.cache())
    doc["files"] = [{"path": CACHE_FILE, "sha256": sha256_file(path), "bytes": path.stat().st_size}]
    (proj.cache() / caches.INDEX).write_text(json.dumps(doc))  # only check_cache can tell now
    report = assert_unused_and_kept(proj, "corrupt", f"{CACHE_FILE} is not a DEC1 decisions file", refresh=True)
    assert report.cache.reason == f"{CACHE_FILE} is not a DEC1 decisions file"


def test_an_index_that_is_not_json_is_corrupt(proj):
    build(proj.registry.pair("conv", "fake"))
    (proj.cache() / caches.INDEX).write_text("{not json")
    assert_unused_and_kept(proj, "corrupt", caches.INDEX, refresh=True)
    assert index(proj.cache())["key"] == {"compiler": "1.0", "target": TARGET}


# --- issue 37: an editor's file beside the cache is ignored, and nothing checked in is removed ---------

EDITOR_FILES = [f".{CACHE_FILE}.swp", f".#{CACHE_FILE}", f"{CACHE_FILE}~", f"#{CACHE_FILE}#", "notes.swp"]


@pytest.mark.parametrize("name", [*EDITOR_FILES, f".{CACHE_FILE}.123.abc.tmp", "sub/.notes.txt.swp"])
def test_an_editors_file_is_ignored_by_name(proj, name):
    """inspect alone (no build): the cache stays fresh and the file is named."""
    build(proj.registry.pair("conv", "fake"))
    (proj.cache() / name).parent.mkdir(parents=True, exist_ok=True)
    (proj.cache() / name).write_bytes(b"")
    row = status_of(proj.registry)
    assert (row.state, row.foreign, row.ignored) == ("fresh", False, [name]), row.reason
    assert caches.editor_file(name) and not caches.editor_file(CACHE_FILE) and not caches.editor_file("notes.txt")


def test_an_editors_swap_file_never_discards_the_checked_in_cache(proj, capsys):
    """The report: an empty swap file in the folder made the next build delete the checked-in files,
    build without them and pass. Now the build replays the cache, keeps every file, and names it."""
    build(proj.registry.pair("conv", "fake"))
    swap = proj.cache() / f".{CACHE_FILE}.swp"
    swap.write_bytes(b"")
    before = listing(proj.cache())
    report = build(proj.registry.pair("conv", "fake"))
    assert SEEN[-1] == {CACHE_FILE: proj.cache() / CACHE_FILE}  # replayed
    rec = report.cache
    assert (rec.state, rec.hits, rec.misses, rec.updated, rec.unused()) == ("fresh", 1, 0, False, None)
    assert rec.ignored == [swap.name]
    assert [w for w in report.warnings if "ignored" in w] == [
        f"caches/fake/conv: ignored {swap.name} (not in {caches.INDEX}; an editor's file by its name): "
        "never read, never removed"
    ]
    assert listing(proj.cache()) == before
    code, out, _ = cli(capsys, "--params", str(proj.params), "cache", "status", "--sku", "fake", "--fail-on", "corrupt")
    assert code == 0 and f"fake/conv: ignored {swap.name} (an editor's files)" in out, out
    # nor does a refresh remove it, or a first build beside it
    cache_commands.refresh(proj.registry, "fake", ["conv"])
    assert swap.is_file() and status_of(proj.registry).state == "fresh"
    (proj.cache() / CACHE_FILE).unlink()
    (proj.cache() / caches.INDEX).unlink()
    rec = build(proj.registry.pair("conv", "fake")).cache
    assert (rec.state, rec.updated, rec.ignored) == ("missing", True, [swap.name])
    assert sorted(listing(proj.cache())) == sorted([caches.INDEX, CACHE_FILE, swap.name])


# --- the folder holds plain files its index lists, and nothing else: a build stops (exit 2) -------------


def test_an_index_rewritten_for_a_new_key_counts_as_an_update(proj, monkeypatch):
    monkeypatch.setattr(f"{__name__}.decisions", lambda: MAGIC + b" the same decisions under every version\n")
    build(proj.registry.pair("conv", "fake"))
    before = (proj.cache() / caches.INDEX).read_bytes()
    monkeypatch.setattr(f"{__name__}.COMPILER_VERSION", "2.0")
    rec = cache_commands.refresh(proj.registry, "fake", ["conv"])[0]
    assert (proj.cache() / caches.INDEX).read_bytes() != before  # git sees a change...
    assert rec["updated"] is True  # ...so the record (and `cache refresh`'s "written") must say so


def outside(proj, name: str = "outside.bin", data: bytes | None = None) -> Path:
    """A file outside the project (beside its folder) with the very bytes of a valid cache file."""
    path = proj.root.parent / name
    path.write_bytes(decisions() if data is None else data)
    return path


def assert_foreign_then_refreshed(proj, *words: str) -> None:
    """cache status says corrupt, naming ``words``; a build stops with exit 2 naming them and what
    to do, having read and removed nothing; ``cache refresh`` then leaves only what the new index
    lists (a link removed, never what it points to)."""
    row = status_of(proj.registry)
    assert (row.state, row.foreign) == ("corrupt", True), (row.state, row.reason)
    for word in words:
        assert word in row.reason, (word, row.reason)
    before, seen = listing(proj.cache()), len(SEEN)
    with pytest.raises(InputError) as info:
        build(proj.registry.pair("conv", "fake"))
    assert info.value.exit_code == 2
    for word in [*words, "skuforge cache refresh --sku fake --model conv"]:
        assert word in str(info.value), (word, str(info.value))
    assert len(SEEN) == seen, "the backend ran on a foreign cache"
    assert listing(proj.cache()) == before, "a build removed or wrote something"
    rec = cache_commands.refresh(proj.registry, "fake", ["conv"])[0]
    assert rec["updated"] is True
    assert not proj.cache().is_symlink()
    assert sorted(listing(proj.cache())) == [caches.INDEX, CACHE_FILE]
    assert status_of(proj.registry).state == "fresh"


def test_cache_files_without_an_index_stop_the_build(proj):
    folder = proj.cache()
    folder.mkdir(parents=True)
    (folder / CACHE_FILE).write_bytes(decisions())  # the very bytes a build would write, but not indexed
    assert_foreign_then_refreshed(proj, CACHE_FILE, f"present but not in {caches.INDEX}")
    doc = index(folder)
    assert doc["files"] == [{"path": CACHE_FILE, "sha256": sha256_file(folder / CACHE_FILE), "bytes": len(decisions())}]
    assert doc["trials"] == 3 and doc["tuned_at"] is not None, doc  # the refresh's search made it


@pytest.mark.parametrize("name", ["notes.txt", "sub/planted.bin", "extra.bin"])
def test_any_other_file_the_index_does_not_list_stops_the_build(proj, monkeypatch, name):
    """Not only the backend's own file names: anything else in the folder, at any depth."""
    monkeypatch.setattr(FakeCacheBackend, "cache_files", (CACHE_FILE, "extra.bin"))
    build(proj.registry.pair("conv", "fake"))
    (proj.cache() / name).parent.mkdir(parents=True, exist_ok=True)
    (proj.cache() / name).write_bytes(b"planted: no build wrote this")
    assert_foreign_then_refreshed(proj, f"{name} present but not in {caches.INDEX}")
    assert not (proj.cache() / name).exists()


def test_a_symlink_out_of_the_project_stops_the_build(proj):
    build(proj.registry.pair("conv", "fake"))
    target = outside(proj, data=b"a secret outside the project")
    (proj.cache() / "leak.bin").symlink_to(target)
    assert_foreign_then_refreshed(
        proj, "leak.bin is a symlink", str(target), "outside the cache folder", "a cache holds plain files only"
    )
    assert target.read_bytes() == b"a secret outside the project"  # the link is removed, never its target


def test_a_symlink_with_an_editors_name_is_still_a_symlink(proj):
    build(proj.registry.pair("conv", "fake"))
    (proj.cache() / f".#{CACHE_FILE}").symlink_to("user@host.123:456")  # emacs's lock file is a link
    assert_foreign_then_refreshed(proj, f".#{CACHE_FILE} is a symlink")


def test_a_listed_cache_file_that_is_a_symlink_stops_the_build_even_when_its_bytes_match(proj):
    """The index vouches for bytes, not for where they live: the same decisions behind a link out
    of the project are not trusted (they used to be: every check followed the link)."""
    build(proj.registry.pair("conv", "fake"))
    target = outside(proj)
    (proj.cache() / CACHE_FILE).unlink()
    (proj.cache() / CACHE_FILE).symlink_to(target)
    assert sha256_file(proj.cache() / CACHE_FILE) == index(proj.cache())["files"][0]["sha256"]
    assert_foreign_then_refreshed(proj, f"{CACHE_FILE} is a symlink", "outside the cache folder")
    assert target.read_bytes() == decisions()


def test_a_symlinked_subfolder_or_index_stops_the_build(proj):
    build(proj.registry.pair("conv", "fake"))
    elsewhere = proj.root.parent / "elsewhere"
    elsewhere.mkdir()
    (proj.cache() / "more").symlink_to(elsewhere, target_is_directory=True)
    assert_foreign_then_refreshed(proj, "more is a symlink")
    assert elsewhere.is_dir()

    real = proj.root.parent / "cache.json"
    real.write_bytes((proj.cache() / caches.INDEX).read_bytes())
    (proj.cache() / caches.INDEX).unlink()
    (proj.cache() / caches.INDEX).symlink_to(real)
    assert_foreign_then_refreshed(proj, f"{caches.INDEX} is a symlink")


def test_a_cache_folder_that_is_a_symlink_stops_the_build_and_a_refresh_makes_it_a_folder(proj):
    build(proj.registry.pair("conv", "fake"))
    elsewhere = proj.root.parent / "shared-cache"
    proj.cache().rename(elsewhere)  # a valid cache, key and files, behind a link
    proj.cache().symlink_to(elsewhere, target_is_directory=True)
    before = tree(elsewhere)
    assert_foreign_then_refreshed(proj, "the cache folder is a symlink", str(elsewhere))
    assert tree(elsewhere) == before  # nothing written or removed through the link


@pytest.mark.parametrize("escape", ["../../../outside.bin", "{outside}", f"sub/../../{CACHE_FILE}"])
def test_an_index_path_out_of_the_folder_stops_the_build(proj, escape):
    build(proj.registry.pair("conv", "fake"))
    target = outside(proj)
    escape = escape.format(outside=target)
    doc = index(proj.cache())
    doc["files"] = [{"path": escape, "sha256": sha256_file(target), "bytes": target.stat().st_size}]
    (proj.cache() / caches.INDEX).write_text(json.dumps(doc))
    (proj.cache() / CACHE_FILE).unlink()
    assert_foreign_then_refreshed(proj, f"{caches.INDEX} lists {escape!r}, which escapes the cache folder")
    assert target.read_bytes() == decisions()


def test_cache_status_fails_on_a_planted_symlink(proj, capsys):
    build(proj.registry.pair("conv", "fake"))
    (proj.cache() / "leak.bin").symlink_to(outside(proj))
    code, out, err = cli(
        capsys, "--params", str(proj.params), "cache", "status", "--sku", "fake", "--fail-on", "corrupt"
    )
    assert code == 1 and "fake/conv is corrupt" in err, err
    assert "leak.bin is a symlink" in out


# --- 6: a required cache fails the build on a miss, and writes nothing ------------------------------


def assert_cache_gate(exc: GateFailed, sku: str) -> None:
    assert exc.exit_code == 1
    assert f"caches/{sku}/conv" in exc.message, exc.message
    assert caches.REQUIRE_ENV in exc.message
    assert f"skuforge cache refresh --sku {sku} --model conv" in str(exc), str(exc)


def test_a_required_cache_that_is_missing_fails_the_build_and_writes_nothing(proj):
    with pytest.raises(GateFailed) as info:
        build(proj.registry.pair("conv", "strict"))
    assert_cache_gate(info.value, "strict")
    assert "missing" in info.value.message
    assert not (proj.cache("strict") / CACHE_FILE).exists()
    assert not (proj.cache("strict") / caches.INDEX).exists()
    assert not proj.engine("strict").exists() and not proj.report("strict").exists()


def test_a_required_cache_that_is_corrupt_fails_and_keeps_the_previous_engine(proj):
    rec = build(proj.registry.pair("conv", "strict"), cache_required=False).cache  # the first build makes it
    assert rec.required is False and rec.state == "missing"
    (proj.cache("strict") / CACHE_FILE).write_bytes(MAGIC + b" corrupted\n")
    engine, cache, report = tree(proj.engine("strict")), tree(proj.cache("strict")), proj.report("strict").read_bytes()
    assert engine and cache

    with pytest.raises(GateFailed) as info:
        build(proj.registry.pair("conv", "strict"))
    assert_cache_gate(info.value, "strict")
    assert "corrupt" in info.value.message
    assert tree(proj.engine("strict")) == engine  # the previous engine, byte for byte
    assert tree(proj.cache("strict")) == cache  # the corrupt file is reported, not replaced
    assert proj.report("strict").read_bytes() == report


def test_a_required_fresh_cache_builds(proj):
    build(proj.registry.pair("conv", "strict"), cache_required=False)
    rec = build(proj.registry.pair("conv", "strict")).cache
    assert (rec.state, rec.hits, rec.misses, rec.required, rec.updated) == ("fresh", 1, 0, True, False)


def test_a_required_stale_cache_fails(proj, monkeypatch):
    build(proj.registry.pair("conv", "strict"), cache_required=False)
    before = tree(proj.cache("strict"))
    monkeypatch.setattr(f"{__name__}.COMPILER_VERSION", "2.0")
    with pytest.raises(GateFailed) as info:
        build(proj.registry.pair("conv", "strict"))
    assert_cache_gate(info.value, "strict")
    assert "stale" in info.value.message and "'2.0'" in info.value.message
    assert tree(proj.cache("strict")) == before


@pytest.mark.parametrize("value", ["1", "true", "YES"])
def test_the_environment_requires_the_cache_of_every_sku(proj, monkeypatch, value):
    monkeypatch.setenv(caches.REQUIRE_ENV, value)
    with pytest.raises(GateFailed) as info:
        build(proj.registry.pair("conv", "fake"))
    assert_cache_gate(info.value, "fake")
    assert tree(proj.cache("fake")) == {}
    assert not proj.engine("fake").exists()


def test_the_environment_flag_off_requires_nothing(proj, monkeypatch):
    monkeypatch.setenv(caches.REQUIRE_ENV, "0")
    rec = build(proj.registry.pair("conv", "fake")).cache
    assert rec.required is False and rec.state == "missing"


def test_the_environment_then_fresh_cache_passes(proj, monkeypatch):
    build(proj.registry.pair("conv", "fake"))
    monkeypatch.setenv(caches.REQUIRE_ENV, "1")
    rec = build(proj.registry.pair("conv", "fake")).cache
    assert (rec.state, rec.required, rec.hits, rec.misses) == ("fresh", True, 1, 0)


def test_cache_required_false_overrides_the_sku_and_the_environment(proj, monkeypatch):
    monkeypatch.setenv(caches.REQUIRE_ENV, "1")
    rec = build(proj.registry.pair("conv", "strict"), cache_required=False).cache
    assert rec.required is False and rec.state == "missing" and rec.updated is True
    assert (proj.cache("strict") / CACHE_FILE).read_bytes() == decisions()


def test_cache_required_true_overrides_a_sku_without_require(proj):
    with pytest.raises(GateFailed):
        build(proj.registry.pair("conv", "fake"), cache_required=True)
    assert tree(proj.cache("fake")) == {}


# --- 7: refresh --------------------------------------------------------------------------------------


def test_refresh_rebuilds_a_fresh_cache(proj):
    build(proj.registry.pair("conv", "fake"))
    # the refresh runs later than the build that made the cache (a second, or a month): the index
    # keeps the tuning that made its files; a search that decides them again changes nothing
    doc = index(proj.cache())
    (proj.cache() / caches.INDEX).write_text(json.dumps({**doc, "tuned_at": "2020-01-01T00:00:00Z"}, indent=2))
    before = tree(proj.cache())
    records = cache_commands.refresh(proj.registry, "fake")
    assert len(records) == 1
    rec = records[0]
    assert (rec["model"], rec["sku"], rec["state"], rec["reason"]) == ("conv", "fake", "missing", REFRESH_REASON)
    assert rec["hits"] == 0 and rec["misses"] >= 1 and rec["required"] is False
    # the fake decides the same bytes again: nothing to write, no diff
    assert rec["updated"] is False
    assert tree(proj.cache()) == before
    assert BuildReport.model_validate(read_json(proj.report())).cache.reason == REFRESH_REASON


def test_refresh_writes_what_the_new_search_decided(proj, monkeypatch):
    build(proj.registry.pair("conv", "fake"))
    monkeypatch.setattr(f"{__name__}.decisions", lambda: MAGIC + b" a better schedule\n")
    rec = cache_commands.refresh(proj.registry, "fake", ["conv"])[0]
    assert rec["state"] == "missing" and rec["updated"] is True
    assert (proj.cache() / CACHE_FILE).read_bytes() == MAGIC + b" a better schedule\n"
    assert index(proj.cache())["trials"] == 3  # a refresh starts afresh: the old trials are not added
    assert status_of(proj.registry).state == "fresh"


def test_refresh_is_never_blocked_by_require(proj, monkeypatch):
    monkeypatch.setenv(caches.REQUIRE_ENV, "1")
    rec = cache_commands.refresh(proj.registry, "strict")[0]  # no cache at all, SKU and environment require one
    assert rec["state"] == "missing" and rec["required"] is False and rec["updated"] is True
    assert (proj.cache("strict") / CACHE_FILE).read_bytes() == decisions()
    assert build(proj.registry.pair("conv", "strict")).cache.state == "fresh"  # and now the release build replays it


def test_refresh_of_a_sku_without_a_cache_is_a_config_error(proj):
    from pipeline.core.errors import ConfigError

    with pytest.raises(ConfigError, match="keeps no cache"):
        cache_commands.refresh(proj.registry, "plain")


# --- 8: the manifest's cache hash ----------------------------------------------------------------------


def test_the_reports_cache_hash_is_the_digest_of_the_indexed_files(proj):
    build(proj.registry.pair("conv", "fake"))
    report = BuildReport.model_validate(read_json(proj.report()))
    files = index(proj.cache())["files"]
    assert report.cache.sha256 == caches.files_digest(files) is not None
    assert [f.to_json() for f in report.cache.files] == files
    assert caches.files_digest([]) is None
    # the digest names content: other bytes, another digest
    other = [{**files[0], "sha256": "0" * 64}]
    assert caches.files_digest(other) != report.cache.sha256


def test_the_manifest_carries_the_cache(proj):
    from pipeline.stages.bench import bench
    from pipeline.stages.manifest import write_manifest
    from pipeline.stages.validate import validate

    build(proj.registry.pair("conv", "fake"))
    rec = build(proj.registry.pair("conv", "fake")).cache  # the replaying build
    validate(proj.registry.pair("conv", "fake"))
    bench(proj.registry.pair("conv", "fake"))
    manifest = write_manifest(proj.registry.pair("conv", "fake")).to_json()
    assert manifest["cache"] == {
        "kind": "timing-cache",
        "sha256": caches.files_digest(index(proj.cache())["files"]),
        "key": {"compiler": "1.0", "target": TARGET},
        "state": "fresh",
        "reason": "key and files match",
        "hits": 1,
        "misses": 0,
        "required": False,
        "ignored": [],
    }
    assert manifest["cache"]["sha256"] == rec.sha256
    [row] = matrix(proj.registry, ["conv"], ["fake"], statuses=[])
    assert (row.outcome, row.cache) == ("passed", "") and "cache" not in row.detail

    # a pair whose build found its cache corrupt (and an editor's file beside it): the manifest says
    # so, and so do the matrix cell, its detail line and the report's colour
    path = proj.out.manifest("conv", "fake")
    doc = read_json(path)
    reason = f"{CACHE_FILE} differs from its sha256 in {caches.INDEX} (edited or truncated)"
    doc["cache"].update(state="corrupt", reason=reason, sha256=None, ignored=[".decisions.bin.swp"])
    path.write_text(json.dumps({**doc, "digest": manifest_digest(doc)}))
    [row] = matrix(proj.registry, ["conv"], ["fake"], statuses=[])
    assert row.outcome == "passed" and row.cache == "cache: corrupt — built without checked-in timing cache"
    assert row.label.startswith("passed (cache: corrupt — built without checked-in timing cache; warn: ")
    assert "cache ignores .decisions.bin.swp" in row.warnings
    assert row.detail.startswith(
        f"cache: corrupt — built without checked-in timing cache (caches/fake/conv: {reason}); rebuild it: "
        "skuforge cache refresh --sku fake --model conv"
    ), row.detail
    assert status_class(row.label) == "passed"


# --- 9, 10: the commands ----------------------------------------------------------------------------


def cli(capsys, *args: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cache_status_command(proj, capsys):
    build(proj.registry.pair("conv", "fake"))
    params = str(proj.params)
    code, out, err = cli(capsys, "--params", params, "cache", "status", "--json")
    assert code == 0, err
    rows = {r["sku"]: r for r in json.loads(out)}
    assert set(rows) == {"fake", "strict"}  # plain: onnxruntime keeps no cache, not listed
    assert rows["fake"]["state"] == "fresh" and rows["strict"]["state"] == "missing"
    assert rows["fake"]["key"] == rows["fake"]["want"] == {"compiler": "1.0", "target": TARGET}
    assert rows["fake"]["sha256"] == caches.files_digest(index(proj.cache())["files"])
    assert rows["fake"]["trials"] == 3 and rows["fake"]["bytes"] == len(decisions())
    assert rows["fake"]["last_build"]["state"] == "missing" and rows["strict"]["last_build"] is None

    assert cli(capsys, "--params", params, "cache", "status", "--sku", "fake", "--fail-on", "not-fresh")[0] == 0
    code, _, err = cli(capsys, "--params", params, "cache", "status", "--fail-on", "not-fresh")
    assert code == 1 and "strict/conv is missing" in err and "fake/conv" not in err, err
    assert cli(capsys, "--params", params, "cache", "status", "--fail-on", "corrupt")[0] == 0  # missing is not corrupt

    (proj.cache() / CACHE_FILE).write_bytes(b"XXXX")
    code, out, err = cli(capsys, "--params", params, "cache", "status", "--fail-on", "corrupt")
    assert code == 1 and "fake/conv is corrupt" in err and "strict" not in err, err
    assert "fake/conv:" in out and "differs from its sha256" in out  # the text table gives the reason
    code, out, _ = cli(capsys, "--params", params, "cache", "status", "--sku", "plain", "--json")
    assert code == 0 and json.loads(out) == []
    code, _, err = cli(capsys, "--params", params, "cache", "status", "--sku", "nosuch")
    assert code == 2 and "nosuch" in err


def test_cache_refresh_command(proj, capsys):
    code, out, err = cli(capsys, "--params", str(proj.params), "cache", "refresh", "--sku", "strict", "--json")
    assert code == 0, err
    [rec] = json.loads(out)
    assert (rec["sku"], rec["model"], rec["state"], rec["reason"]) == ("strict", "conv", "missing", REFRESH_REASON)
    assert status_of(proj.registry, "strict").state == "fresh"
    code, _, err = cli(capsys, "--params", str(proj.params), "cache", "refresh", "--sku", "plain")
    assert code == 2 and "keeps no cache" in err


CAPABILITY_KEYS = {
    "backend",
    "precisions",
    "devices",
    "per_node_precision",
    "intermediate_outputs",
    "cache",
    "calibration",
    "runtime_package",
}


def test_backends_command_lists_every_backend(capsys):
    code, out, err = cli(capsys, "backends", "--json")
    assert code == 0, err
    rows = json.loads(out)
    assert [r["backend"] for r in rows] == list(backends_pkg.known_backends())
    for row in rows:
        assert set(row) == CAPABILITY_KEYS, row
        assert row == {"backend": row["backend"], **backends_pkg.backend_class(row["backend"]).capabilities.to_json()}
    by_name = {r["backend"]: r for r in rows}
    assert by_name["fakecache"]["cache"] == "timing-cache" and by_name["onnxruntime"]["cache"] is None


def test_backends_markdown_is_the_table_of_the_docs(capsys):
    with backends_pkg.registered_backend("fakecache", None):  # the docs list the real backends
        code, out, err = cli(capsys, "backends", "--markdown")
        real = backends_pkg.known_backends()
    assert code == 0, err
    lines = out.strip().splitlines()
    assert lines[0].startswith("| backend |") and len(lines) == 2 + len(real)
    assert all(f"| `{name}` |" in out for name in real)
    doc = REPO / "docs" / "backends.md"
    if not doc.is_file():
        pytest.skip("docs/backends.md does not exist yet: the table cannot be compared")
    assert out.strip() in doc.read_text(), "docs/backends.md's table differs from `skuforge backends --markdown`"


def test_the_example_checks_in_a_cache_record_for_every_pair_a_cpu_host_builds():
    """A build writes caches/<sku>/<model>/cache.json (a DVC output kept in git) on whichever host can
    build the pair: those of every pair an x86-64 CPU host may build (its own CPU SKUs, whatever the
    flags, and the cross-built ones) must be in git, or the README's command leaves git dirty on the
    first host that builds a pair no earlier host could (the VNNI SKUs on an AVX-512 VNNI CPU). A GPU
    SKU's record is written on its runner, with its timing cache (CI commits it)."""
    import subprocess

    root = Path(__file__).resolve().parents[1]
    if not (root / ".git").exists():
        pytest.skip("not a git checkout: the tracked files cannot be listed")
    listed = subprocess.run(["git", "ls-files", "caches"], cwd=root, capture_output=True, text=True, check=True)
    tracked = set(listed.stdout.split())
    registry = load_registry(root / "params.yaml")
    missing = []
    for model, sku in registry.pairs():
        spec = registry.skus[sku]
        on_cpu_host = spec.target.arch == "x86_64" and spec.target.device == "cpu"
        if (on_cpu_host or get_backend(spec.backend).cross_compiles(spec)) and (
            f"caches/{sku}/{model}/cache.json" not in tracked
        ):
            missing.append(f"caches/{sku}/{model}/cache.json")
    assert not missing, f"commit the cache records a build writes: {missing}"
