"""An aarch64 Python run under QEMU user-mode emulation on an x86-64 host (issue 40).

The environment: a Debian ``bookworm`` arm64 sysroot (``python3.11`` and the closure of its
dependencies, fetched with apt under a private configuration, so the system's apt is untouched, and
unpacked with ``dpkg -x``) and a ``site-packages`` of PyPI's manylinux aarch64 wheels: the packages
asked for, at the versions asked for (the host's, so an emulated runtime is the host's release), and
their runtime dependencies at the host's versions. No binfmt is needed: ``qemu-aarch64-static -L
<sysroot>`` runs the sysroot's python. Two things are required for correct runs: the emulated CPU
is a Cortex-A76 (``QEMU_CPU``; qemu's default ``max`` has SVE, where XNNPACK's INT8 kernels compute
wrong numbers), and ``<sysroot>/proc/cpuinfo`` describes it (qemu reads it in place of the host's;
without it ``import onnxruntime`` crashes). The emulated python cannot start processes.

Where it lives: ``emulation-aarch64-<sha256[:12]>`` in ``$SKUFORGE_EMULATION_DIR`` (skuforge's cache
folder), hashed over what defines it (the packages and their runtime dependencies at the host's versions,
the recipe): a host whose numpy or ml_dtypes changes gets a new environment, not a stale one. It is made in a
staging folder renamed into place, and whole only when its stamp, written last, names the same
definition. ``python -m pipeline.host.emulation [--force]`` makes it (scripts/setup.sh).
"""

from __future__ import annotations

import compileall
import contextlib
import functools
import json
import platform
import re
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path
from urllib.parse import unquote

from packaging.requirements import Requirement

from pipeline.core.env import SKUFORGE_EMULATION_DIR, process_environment
from pipeline.core.errors import EnvironmentProblem
from pipeline.core.io import (
    atomic_dir,
    atomic_write_bytes,
    atomic_write_json,
    file_lock,
    read_json,
    sha256_file,
    sha256_json,
)
from pipeline.core.paths import cache_dir

EMULATOR = "qemu-aarch64-static"
QEMU_CPU = "cortex-a76"
RECIPE = 1  # raised when what prepare() makes changes: every environment is made again
SUITE, GLIBC_MINOR = "bookworm", 36  # Debian's python3.11 and its glibc (the wheels' manylinux tags)
ROOT_DEBS = ("python3.11", "libstdc++6", "libgcc-s1", "libgomp1")
DEFAULT_MIRROR = "http://deb.debian.org/debian"
KEYRING = "/usr/share/keyrings/debian-archive-keyring.gpg"
# the runtimes an emulated engine may need, where this host has them (apache-tvm: 95 MB of wheel, the
# runtime of an emulated TVM RPC server)
RUNTIMES = ("numpy", "onnxruntime", "ai-edge-litert", "apache-tvm")
IMPORTS = {"numpy": "numpy", "onnxruntime": "onnxruntime", "ai-edge-litert": "ai_edge_litert.interpreter"}
IMPORTS["apache-tvm"] = "tvm"
STAMP = "skuforge-emulation.json"
SETUP_HINT = "scripts/setup.sh --with emulation"
TIMEOUT_S = 1800
NO_WHEEL = "no manylinux aarch64 wheel for cp311 on PyPI"
CPUINFO = "".join(
    f"processor\t: {n}\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp "
    "asimdhp cpuid asimdrdm lrcpc dcpop asimddp\nCPU implementer\t: 0x41\nCPU architecture: 8\n"
    "CPU variant\t: 0x4\nCPU part\t: 0xd0b\nCPU revision\t: 1\n\n"
    for n in range(4)
)
# the markers of a requirement, evaluated for the emulated python
_TARGET = {"python_version": "3.11", "python_full_version": "3.11.2", "sys_platform": "linux", "os_name": "posix"}
_TARGET |= {"platform_system": "Linux", "platform_machine": "aarch64", "implementation_name": "cpython", "extra": ""}
# a wheel file the emulated python installs: its python-abi-platform tags
_WHEEL = r"-(cp311-cp311|cp3([2-9]|10|11)-abi3|(py2\.)?py3-none)-([\w.]*manylinux[\w.]*aarch64[\w.]*|any)\.whl$"


def _canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _key(packages: Mapping[str, str]) -> str:
    pins = _pinned_closure(frozenset(packages.items()))
    return sha256_json({"recipe": RECIPE, "suite": SUITE, "debs": ROOT_DEBS, "packages": pins, "cpu": QEMU_CPU})


@functools.lru_cache(maxsize=8)
def _pinned_closure(packages: frozenset[tuple[str, str]]) -> dict[str, str]:
    """_closure sorted by name, once per process (about 25 ms of package metadata): the key and the
    wheels installed come from this one answer."""
    return dict(sorted(_closure(dict(packages)).items()))


def env_dir(packages: Mapping[str, str]) -> Path:
    """The environment of these packages (name -> version) in skuforge's cache folder."""
    return (SKUFORGE_EMULATION_DIR.get() or cache_dir()) / f"emulation-aarch64-{_key(packages)[:12]}"


def sysroot(env: Path) -> Path:
    return env / "sysroot"


def site_packages(env: Path) -> Path:
    return env / "site-packages"


def host_versions() -> dict[str, str]:
    """The runtimes this host has installed (name -> version): what the emulated ones should be."""
    out = {}
    for name in RUNTIMES:
        with contextlib.suppress(metadata.PackageNotFoundError):
            out[name] = metadata.version(name)
    return out


def _host_problems() -> list[str]:
    machine = platform.machine().lower()
    if machine in ("aarch64", "arm64"):
        return ["this host is aarch64: it runs the aarch64 runtimes natively, without emulation"]
    if machine not in ("x86_64", "amd64"):
        return [f"emulation of aarch64 is made on x86_64 hosts only (this one is {machine})"]
    return [] if shutil.which(EMULATOR) else [f"needs qemu-user-static ({SETUP_HINT})"]


def problems(packages: Mapping[str, str]) -> list[str]:
    """Why these packages cannot run under emulation now (empty: they can). Starts no process."""
    found = _host_problems()
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return found
    env = env_dir(packages)
    stamp, made = env / STAMP, {}
    if not (sysroot(env) / "usr" / "bin" / "python3.11").is_file():
        with contextlib.suppress(OSError):  # the last attempt's reason (a runtime without an aarch64 wheel)
            return [*found, f"the aarch64 environment could not be made: {_failed(env).read_text().strip()}"]
        return [*found, f"the aarch64 environment {env} does not exist ({SETUP_HINT})"]
    if not stamp.is_file():
        return [*found, f"the aarch64 environment {env} is incomplete (its making did not finish)"]
    with contextlib.suppress(OSError, ValueError):
        made = read_json(stamp)
    if made.get("key") != _key(packages):
        return [*found, f"the aarch64 environment {env} was made for other versions ({made.get('packages')})"]
    return found


def _run(argv: list[str], what: str, hint: str, env: Mapping[str, str] | None = None, check: bool = True) -> str:
    """Run a host tool; its output. A failure (with ``check``) is an EnvironmentProblem naming ``what``."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT_S, env=env)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise EnvironmentProblem(f"could not {what}: {exc}", hint=hint) from None
    if check and done.returncode != 0:
        tail = " | ".join((done.stdout + done.stderr).strip().splitlines()[-4:])
        raise EnvironmentProblem(f"could not {what} (exit {done.returncode}): {tail}", hint=hint)
    return "" if done.returncode == 0 else done.stdout + done.stderr


def _mirror() -> tuple[str, str]:
    """The host's Debian mirror serving ``SUITE`` and its keyring (Debian's own mirror otherwise)."""
    texts = [p.read_text(errors="replace") for p in Path("/etc/apt").glob("sources.list*") if p.is_file()]
    texts += [p.read_text(errors="replace") for p in sorted(Path("/etc/apt/sources.list.d").glob("*"))]
    for text in texts:
        for block in re.split(r"\n\s*\n", text):  # deb822 stanzas
            fields = dict(re.findall(r"^([A-Za-z-]+):[ \t]*(.*)$", block, re.M))
            if SUITE in fields.get("Suites", "").split() and "deb" in fields.get("Types", "").split():
                return fields.get("URIs", DEFAULT_MIRROR).split()[0], fields.get("Signed-By", KEYRING).strip()
        for options, uri in re.findall(rf"^deb\s+(\[[^]]*\]\s+)?(\S+)\s+{SUITE}\s", text, re.M):
            signed = re.search(r"signed-by=([^]\s]+)", options)
            return uri, signed.group(1) if signed else KEYRING
    return DEFAULT_MIRROR, KEYRING


# apt's private configuration: arm64 only, every folder its own (the system's configuration is not read)
APT_CONF = """APT::Architecture "arm64"; APT::Architectures {{ "arm64"; }}; APT::Install-Recommends "false";
Dir::Etc "{w}/etc"; Dir::Etc::Parts "{w}/none"; Dir::Etc::PreferencesParts "{w}/none";
Dir::Etc::SourceList "{w}/etc/sources.list"; Dir::Etc::SourceParts "{w}/none";
Dir::State "{w}/state"; Dir::State::status "{w}/state/status"; Dir::Cache "{w}/cache";
Debug::NoLocking "true"; Acquire::Languages "none"; APT::Sandbox::User "root";
"""


def _sysroot(root: Path, work: Path) -> dict[str, str]:
    """Fetch (apt, private configuration in ``work``) and unpack the arm64 packages into ``root``;
    their versions (name -> version)."""
    mirror, keyring = _mirror()
    if not Path(keyring).is_file():
        raise EnvironmentProblem(f"the keyring {keyring} is missing", hint="apt-get install debian-archive-keyring")
    for sub in ("etc", "none", "state/lists/partial", "cache/archives/partial"):
        (work / sub).mkdir(parents=True, exist_ok=True)
    (work / "state" / "status").touch()
    (work / "etc" / "sources.list").write_text(f"deb [arch=arm64 signed-by={keyring}] {mirror} {SUITE} main\n")
    (work / "apt.conf").write_text(APT_CONF.format(w=work))
    env = {**process_environment(), "APT_CONFIG": str(work / "apt.conf"), "LC_ALL": "C"}
    hint = f"check that {mirror} is reachable (and serves {SUITE} arm64)"
    _run(["apt-get", "update", "-q", "--error-on=any"], f"read the arm64 package lists of {mirror} {SUITE}", hint, env)
    what = f"download the arm64 packages {' '.join(ROOT_DEBS)} and their dependencies from {mirror}"
    _run(["apt-get", "install", "--download-only", "-y", "-q", *ROOT_DEBS], what, hint, env)
    debs = {}
    for deb in sorted((work / "cache" / "archives").glob("*.deb")):
        _run(["dpkg-deb", "-x", str(deb), str(root)], f"unpack {deb.name}", "is dpkg-deb installed?")
        name, version, _arch = unquote(deb.name[: -len(".deb")]).split("_")
        debs[name] = version
    (root / "proc").mkdir(exist_ok=True)
    (root / "proc" / "cpuinfo").write_text(CPUINFO)
    return debs


def _closure(packages: Mapping[str, str]) -> dict[str, str]:
    """The packages and their runtime requirements on the emulated python (name -> version: the
    host's where it has the package, else "", the newest)."""
    pins, todo = {_canon(k): v for k, v in packages.items()}, list(packages)
    while todo:
        try:
            requires = metadata.requires(todo.pop()) or []
        except metadata.PackageNotFoundError:
            continue  # not on the host: its requirements are unknown (the import check finds what lacks)
        for req in map(Requirement, requires):
            if _canon(req.name) in pins or (req.marker is not None and not req.marker.evaluate(_TARGET)):
                continue
            try:
                pins[_canon(req.name)] = metadata.version(req.name)
            except metadata.PackageNotFoundError:
                pins[_canon(req.name)] = ""
            todo.append(req.name)
    return pins


def _on_pypi(name: str, version: str) -> bool | None:
    """Whether PyPI has a wheel of ``name`` ``version`` for the emulated python; None: PyPI not reached."""
    url, accept = f"https://pypi.org/simple/{_canon(name)}/", {"Accept": "application/vnd.pypi.simple.v1+json"}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=accept), timeout=60) as answer:
            files = [f["filename"] for f in json.load(answer)["files"]]
    except urllib.error.HTTPError as exc:
        return False if exc.code == 404 else None
    except (OSError, ValueError, KeyError):
        return None
    return any(f"-{version}-" in file and re.search(_WHEEL, file) for file in files)


def _wheels(target: Path, work: Path, packages: Mapping[str, str]) -> dict[str, str]:
    """Download the aarch64 wheels of the packages' closure into ``work``, install them into
    ``target``; their sha256 (file name -> sha256)."""
    closure = _pinned_closure(frozenset(packages.items()))  # what the environment's key was hashed over
    reqs = [f"{name}=={version}" if version else name for name, version in closure.items()]
    tags = ["--python-version", "3.11", "--implementation", "cp", "--abi", "cp311", "--only-binary=:all:", "--no-deps"]
    for platform_tag in ["manylinux2014", *(f"manylinux_2_{minor}" for minor in range(17, GLIBC_MINOR + 1))]:
        tags += ["--platform", f"{platform_tag}_aarch64"]
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    what = f"download the aarch64 wheels of {', '.join(reqs)}"
    hint = "check the network and pip's index (`pip config list`)"
    out = _run([*pip, "download", "-d", str(work), *tags, *reqs], what, hint, check=False)
    if out:
        missing = re.search(r"No matching distribution found for (\S+?)(?:==(\S+))?\s*$", out, re.M)
        if missing and missing.group(2):  # a reached index has no such wheel, or the index was not reached
            name, version = missing.group(1), missing.group(2)
            on_pypi = _on_pypi(name, version)
            if on_pypi is False or (on_pypi is None and "(from versions: none)" not in out):
                raise EnvironmentProblem(
                    f"{name} {version}: {NO_WHEEL}",
                    hint=f"an emulated runtime is the host's release: install a {name} release that has aarch64 wheels",
                )
        errors = [line for line in out.splitlines() if line.startswith("ERROR")] or out.strip().splitlines()
        raise EnvironmentProblem(f"could not {what}: {' | '.join(errors[-3:])}", hint=hint)
    wheels = sorted(work.glob("*.whl"))
    _run([*pip, "install", "--target", str(target), *tags, *map(str, wheels)], "install the aarch64 wheels", hint)
    return {wheel.name: sha256_file(wheel) for wheel in wheels}


def _argv(env: Path, *python_args: str) -> tuple[list[str], dict[str, str]]:
    root = sysroot(env)
    argv = [shutil.which(EMULATOR) or EMULATOR, "-L", str(root), str(root / "usr" / "bin" / "python3.11"), *python_args]
    clean = {"QEMU_CPU": QEMU_CPU, "QEMU_LD_PREFIX": str(root), "PYTHONPATH": str(site_packages(env))}
    clean |= {"PYTHONNOUSERSITE": "1", "PYTHONDONTWRITEBYTECODE": "1", "LC_ALL": "C.UTF-8", "PATH": "/usr/bin:/bin"}
    clean |= {"HOME": str(Path.home())}
    return argv, clean


def command(env: Path, script: Path, *args: str) -> tuple[list[str], dict[str, str]]:
    """The argv and the whole environment (nothing of this process's) that run ``script`` under emulation."""
    return _argv(env, str(script), *args)


def prepare(packages: Mapping[str, str], force: bool = False) -> Path:
    """Make the environment of these packages (once; concurrent callers wait for the first); its folder."""
    found = _host_problems()
    if found:
        raise EnvironmentProblem(f"cannot make an aarch64 environment: {'; '.join(found)}", hint=SETUP_HINT)
    for tool in ("apt-get", "dpkg-deb"):
        if not shutil.which(tool):
            raise EnvironmentProblem(f"making the aarch64 environment needs {tool} (a Debian or Ubuntu host)")
    env = env_dir(packages)
    with file_lock(env.parent / f".{env.name}.lock"):
        if not force and not problems(packages):
            return env
        try:
            _make(env, packages)
        except EnvironmentProblem as exc:  # kept for the host checks: the SKUs name it, not "does not exist"
            atomic_write_bytes(_failed(env), f"{exc.message} ({SETUP_HINT} tries again)\n".encode())
            raise
        _failed(env).unlink(missing_ok=True)
    return env


def _failed(env: Path) -> Path:
    return env.parent / f".{env.name}.failed"


def _make(env: Path, packages: Mapping[str, str]) -> None:
    """The environment made in a staging folder renamed into place; its stamp written last."""
    with atomic_dir(env) as tmp:
        debs = _sysroot(sysroot(tmp), tmp / "apt")
        wheels = _wheels(site_packages(tmp), tmp / "wheels", packages)
        shutil.rmtree(tmp / "apt")
        shutil.rmtree(tmp / "wheels")
        if sys.version_info[:2] == (3, 11):  # bytecode is the same on every CPU: compile it here, not emulated
            for folder in (sysroot(tmp) / "usr" / "lib" / "python3.11", site_packages(tmp)):
                compileall.compile_dir(folder, quiet=2)
        modules = sorted(IMPORTS[name] for name in map(_canon, packages) if name in IMPORTS)
        argv, clean = _argv(tmp, "-c", f"import {', '.join(modules or ['sys'])}")
        _run(argv, f"import {', '.join(modules)} under emulation", SETUP_HINT, clean)
        stamp = {"key": _key(packages), "recipe": RECIPE, "packages": dict(packages), "suite": SUITE}
        atomic_write_json(tmp / STAMP, stamp | {"debs": debs, "wheels": wheels})  # last: the environment is whole


def versions(env: Path) -> dict[str, object]:
    """What a manifest records of an emulated run: the emulator, the CPU, the sysroot and the wheels."""
    made = read_json(env / STAMP)
    try:
        emulator = subprocess.run([EMULATOR, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        emulator = ""
    debs = made.get("debs", {})  # Debian's name and version fix a package's bytes: their digest names the sysroot
    root = {"suite": made.get("suite"), "packages": debs, "sha256": sha256_json(debs)}
    first = (emulator.strip().splitlines() or ["unknown"])[0]
    return {"emulator": first, "cpu": QEMU_CPU, "sysroot": root, "wheels": made.get("wheels", {})}


def main(argv: list[str]) -> int:
    packages = host_versions()
    try:
        env = prepare(packages, force="--force" in argv)
    except EnvironmentProblem as exc:
        print(f"could not make the aarch64 environment: {exc}", file=sys.stderr)
        return exc.exit_code
    print(env)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
