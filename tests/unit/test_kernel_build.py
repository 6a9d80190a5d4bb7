"""The kernels' build cache (issue 33, item 9): a build killed mid-way does not block the next start,
a live build is waited for with one message, and set-up's command and a first use share one build.

The build runs in a fresh cache (TORCH_EXTENSIONS_DIR), never in the one the environment uses. That
cache is seeded with the environment's finished build less the library, so the build killed here and
the one that follows only link; with no finished build to copy, they compile every unit.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import threading
import time
from pathlib import Path

import pytest

from ruvllm import cpu_build

ROOT = Path(__file__).resolve().parents[2]
SETUP = [sys.executable, "-I", "-W", "ignore", str(ROOT / "src" / "ruvllm" / "cpu_build.py")]  # bootstrap.sh's
FIRST_USE = [sys.executable, "-c", "import logging, sys; logging.basicConfig(level=logging.INFO, format='%(message)s');"
             "from ruvllm.cpu_build import kernels; sys.exit(kernels() is None)"]


def _seed(cache: Path) -> None:
    """Copy the environment's finished build (ninja's files and the objects) into `cache`, leaving out
    the library, so ninja has its link left to do. (It left out a source's object too, to be compiled:
    since the sources build as two translation units that costs ~19 s of CPU, where the lock, the
    kill and the one shared build are what is tested, and a link holds the lock as a compile does.)"""
    from torch.utils.cpp_extension import _get_build_directory

    name = f"ruvllm_cpu_kernels_{cpu_build.build_tag(cpu_build.SOURCES + cpu_build.HEADERS)}"
    env_dir = Path(_get_build_directory(name, verbose=False))  # before TORCH_EXTENSIONS_DIR points here
    objects = [env_dir / (s.stem + ".o") for s in cpu_build.SOURCES]
    if not all(o.exists() for o in objects) or not (env_dir / ".ninja_log").exists():
        return  # nothing finished to copy: the whole build runs
    target = cache / env_dir.name  # TORCH_EXTENSIONS_DIR holds the build folders themselves
    target.mkdir(parents=True)
    for f in [*objects, env_dir / ".ninja_deps", env_dir / "build.ninja"]:
        if f.exists():
            shutil.copy2(f, target / f.name)  # mtimes kept: ninja judges by them and by its log
    # ninja's log without the library's line, as a build killed before its link finished leaves it:
    # with the line, the library a killed link leaves half written would count as built.
    log = (env_dir / ".ninja_log").read_text().splitlines(keepends=True)
    kept = [line for line in log if line.rstrip().split("\t")[3:4] != [f"{name}.so"]]
    (target / ".ninja_log").write_text("".join(kept))
    # The environment's precompiled torch headers too (~14 s of CPU to make again): linked, 300 MB.
    pch = env_dir.parent / cpu_build._pch_setup()[2]
    if (pch / (cpu_build.PCH_HEADER.name + ".gch")).exists():
        (cache / pch.name).mkdir()
        for f in pch.iterdir():
            if not f.name.endswith(".tmp"):
                try:
                    os.link(f, cache / pch.name / f.name)
                except OSError:  # another file system
                    shutil.copy2(f, cache / pch.name / f.name)


def _kill_orphans(cache: Path) -> None:
    """Kill what the killed build's ninja left running, and wait for it. ninja starts each compiler in
    a process group of its own, so the kill of the build's group misses them; under load one outlived
    the set-up build below and wrote its object after that build had linked, so the first use saw a
    newer object and linked again (a CI failure of this test, session 16). A build killed as a whole
    leaves nothing running: make that so here, rather than race the compilers."""
    import psutil

    procs = []
    for p in psutil.process_iter(["cwd"]):
        cwd = p.info.get("cwd")
        if cwd and Path(cwd).is_relative_to(cache):
            procs.append(p)
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
    psutil.wait_procs(procs, timeout=30)


def _hold(folder: Path, pid: str) -> object:
    """A live builder: the owner flock held (by another open file, as another process would) and torch's lock."""
    owner = open(folder / "lock.owner", "a+")
    fcntl.flock(owner, fcntl.LOCK_EX)
    owner.truncate(0)
    owner.write(pid)
    owner.flush()
    (folder / "lock").touch()
    return owner


def test_a_live_build_is_waited_for_with_one_message(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    owner = _hold(tmp_path, "4242")

    def finish() -> None:  # the builder's end: torch removes its lock, the flock goes
        (tmp_path / "lock").unlink()
        owner.close()

    threading.Timer(1.0, finish).start()
    start = time.monotonic()
    with caplog.at_level(logging.INFO, logger="ruvllm.cpu_build"), cpu_build._build_lock(tmp_path):
        waited = time.monotonic() - start
        assert (tmp_path / "lock.owner").read_text() == str(os.getpid())
    assert waited >= 0.9
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "being built by process 4242" in said[0] and "waiting for it" in said[0], said

    # A holder that never finishes: the start gives up after BUILD_WAIT_S (kernels() then falls back).
    monkeypatch.setattr(cpu_build, "BUILD_WAIT_S", 0.5)
    owner = _hold(tmp_path, "4343")
    try:
        with pytest.raises(TimeoutError, match="process 4343 has held the build"), cpu_build._build_lock(tmp_path):
            pass
        assert (tmp_path / "lock").exists()  # a live builder's lock is never removed
    finally:
        owner.close()


@pytest.mark.skipif(shutil.which(os.environ.get("CXX", "c++")) is None,
                    reason="no C++ compiler: the kernels cannot be built")
def test_a_killed_build_does_not_block_and_setup_and_first_use_share_the_build(tmp_path: Path) -> None:
    _seed(tmp_path)
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(FIRST_USE, env=env, start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob("*/lock")):
        assert proc.poll() is None and time.monotonic() < deadline, "the build never took its lock"
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)  # the interpreter and ninja
    proc.wait()
    _kill_orphans(tmp_path)
    (lock,) = tmp_path.glob("*/lock")  # left behind, as torch leaves it
    build_dir = lock.parent

    # Set-up's command after the kill, with PATH as a login shell has it (a system ninja may come
    # first), then a first use with the environment's bin folder first (its own ninja): one build.
    # timeout: a build under load (~30-200 s), well short of the 15 minutes a dead lock used to cost.
    setup = subprocess.run(SETUP, env=env, capture_output=True, text=True, timeout=600)
    assert setup.returncode == 0, setup.stderr
    assert "of a killed build (its process " in setup.stderr and "stale" not in setup.stderr, setup.stderr
    built = {p.name: p.stat().st_mtime_ns for p in build_dir.iterdir() if p.suffix in (".o", ".so")}
    assert len(built) == len(cpu_build.SOURCES) + 1, built
    scripts = sysconfig.get_path("scripts")
    first = subprocess.run(FIRST_USE, env={**env, "PATH": scripts + os.pathsep + env.get("PATH", "")},
                           capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stderr
    assert {p.name: p.stat().st_mtime_ns for p in build_dir.iterdir() if p.suffix in (".o", ".so")} == built
    assert not lock.exists()


def test_every_source_is_in_exactly_one_translation_unit() -> None:
    """A source left out of both units (csrc/loops_unit.cpp, csrc/kernels_unit.cpp) would leave its
    operators unregistered, found only when the library loads; one in both would define its functions
    twice."""
    root = Path(cpu_build.__file__).parent
    sources = sorted(p.resolve() for p in root.glob("**/csrc/*.cpp") if p.resolve() not in cpu_build.SOURCES)
    included = sorted(s for unit in cpu_build.SOURCES for s in cpu_build.unit_sources(unit))
    assert included == sources


@pytest.mark.skipif(shutil.which(os.environ.get("CXX", "c++")) is None,
                    reason="no C++ compiler: the kernels cannot be built")
def test_the_sources_compile_with_the_precompiled_torch_headers(tmp_path: Path) -> None:
    """gcc uses a .gch only when it was made with the build's own flags, and otherwise parses the
    headers in silence (2.5x the CPU a source): a source compiled with the environment's build
    flags, read from its ninja file, must find the .gch valid (-Werror=invalid-pch) and use it."""
    from torch.utils.cpp_extension import _get_build_directory

    if cpu_build.kernels() is None:
        pytest.fail("the kernels did not build")
    name = f"ruvllm_cpu_kernels_{cpu_build.build_tag(cpu_build.SOURCES + cpu_build.HEADERS)}"
    build_dir = Path(_get_build_directory(name, verbose=False))
    cflags = next(line.split("=", 1)[1] for line in (build_dir / "build.ninja").read_text().splitlines()
                  if line.startswith("cflags ="))
    header = cpu_build._precompiled_header(build=True)  # made by set-up's build; here if that was before it
    relative = os.path.relpath(header, build_dir)
    assert f"-include {relative}" in cflags
    source = tmp_path / "one.cpp"
    source.write_text("#include <ATen/core/Tensor.h>\nint64_t rows(const at::Tensor& x) { return x.size(0); }\n")
    done = subprocess.run(f"{os.environ.get('CXX', 'c++')} {cflags} -Werror=invalid-pch -H -c {source} -o {tmp_path / 'one.o'}",
                          shell=True, capture_output=True, text=True, cwd=build_dir)  # where ninja compiles
    assert done.returncode == 0, done.stderr[-2000:]
    first = done.stderr.splitlines()[0]  # -H: "! <file>" is a precompiled header used, "x" one refused
    assert first.startswith("! ") and (build_dir / first[2:]).resolve() == Path(f"{header}.gch").resolve(), done.stderr[:300]


@pytest.mark.skipif(shutil.which(os.environ.get("CXX", "c++")) is None,
                    reason="no C++ compiler: the kernels cannot be built")
def test_a_native_build_targets_the_vector_instructions_the_cpu_has(monkeypatch: pytest.MonkeyPatch) -> None:
    """-march=native takes the CPU's own instructions (a compiler that did not would leave every kernel
    on its plain C++ path, several times slower, with nothing failing); RUVLLM_KERNEL_ARCH names
    another target (scripts/test_isa.sh), and the build's name differs with it."""
    try:
        flags = set(next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")).split())
    except (OSError, StopIteration):
        pytest.skip("no /proc/cpuinfo to compare with")
    wanted = {"avx2", "fma", "f16c", "avx512f", "avx512vl", "avx512_vnni", "avx_vnni", "amx_tile"}
    native_isa = {name.replace("avx512vnni", "avx512_vnni").replace("avxvnni", "avx_vnni")
                  for name in cpu_build.target_isa()} if cpu_build.ARCH == "native" else None
    if native_isa is not None:
        assert native_isa & wanted == flags & wanted
    monkeypatch.setattr(cpu_build, "CFLAGS", [f if not f.startswith("-march=") else "-march=x86-64" for f in cpu_build.CFLAGS])
    assert cpu_build.target_isa() == []  # the plain C++ paths any x86-64 runs
    sources = cpu_build.SOURCES + cpu_build.HEADERS
    monkeypatch.setattr(cpu_build, "ARCH", "x86-64")
    other = cpu_build.build_tag(sources)
    monkeypatch.setattr(cpu_build, "ARCH", "native")
    assert cpu_build.build_tag(sources) != other


def test_the_process_libstdcxx_is_linked_where_the_compiler_would_take_the_static_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A compiler that finds no libstdc++.so (the H200 image's /opt/gcc/bin/g++, session 21) would
    link libstdc++.a into the kernels, whose error messages then crashed the process: the process's
    own libstdc++.so.6 is named on the link line instead. A compiler that finds it links it itself."""
    fake = tmp_path / "c++"
    fake.write_text("#!/bin/sh\necho libstdc++.so\n")  # what gcc prints for a library it cannot find
    fake.chmod(0o755)
    monkeypatch.setenv("CXX", str(fake))
    [lib] = cpu_build._shared_libstdcxx()
    assert Path(lib).is_file() and Path(lib).name.startswith("libstdc++.so")
    monkeypatch.delenv("CXX")
    real = subprocess.run(["c++", "-print-file-name=libstdc++.so"], capture_output=True, text=True).stdout.strip()
    assert (cpu_build._shared_libstdcxx() == []) == os.path.isabs(real)
