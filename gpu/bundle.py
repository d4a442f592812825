"""`make gpu-bundle`: build `.gpu-bundle/`, everything an offline GPU machine lacks to run `make gpu-check`.

The GPU machine (see docs/gpu-check.md) has Python 3.12, its own CUDA build of torch and many
common packages, but no Ray, no mixtrain and no network. This script, run where pip can reach an index,
puts into one folder (ignored by git, carried to the GPU machine with the working tree):

- Ray's wheel for that Python, unpacked WITHOUT the parts mixtrain never loads (the Java jars, RLlib,
  Serve, Data, Tune, the LLM library and the dashboard's web client) and packed as a `.tar.xz`:
  the wheel is 79 MB, which alone would break the 64 MiB limit on what travels; packed this way it is
  about 21 MB;
- the wheels of the Python packages that Ray or mixtrain require and that the GPU machine's image does not
  hold (IMAGE_PACKAGES, read off that image): Ray's own requirements only, not those of `ray[default]`'s
  dashboard and metrics agents, which an embedded `ray.init(include_dashboard=False)`, actors and placement
  groups do without;
- mixtrain's own wheel (`pip wheel --no-deps`, built from a clean copy of the source tree);
- `manifest.json`: the target Python, every file with its size and SHA-256, what was pruned from Ray, and a
  digest of `src/` so the check can say when the bundle is older than the source.

Downloads are cached in `.gpu-cache/` (also ignored, never carried), so a second build needs no network.

    python -m gpu.bundle                          # for the GPU machine: CPython 3.12, manylinux x86-64
    python -m gpu.bundle --python-version 3.11    # for this machine's Python (the tests install it here)
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

from gpu.digest import source_digest

REPO = Path(__file__).resolve().parent.parent
RAY_VERSION = "2.60.0"

RAY_PRUNE = (
    "ray/jars/",  # Java workers
    "ray/rllib/",
    "ray/serve/",
    "ray/data/",
    "ray/tune/",
    "ray/llm/",
    "ray/dashboard/client/",  # the dashboard's built web page (mixtrain starts Ray without the dashboard)
)
"""Parts of Ray's wheel left out: mixtrain imports none of them (`ray/__init__.py` loads them lazily)."""

PINS = {
    "jsonschema": "4.26.0",
    "jsonschema-specifications": "2025.9.1",
    "referencing": "0.37.0",
    "rpds-py": "2026.9.1",
}
"""Versions of the bundled dependencies: those the test suite runs with. A requirement not pinned here is
downloaded at its newest version that satisfies it (and the build says so)."""

IMAGE_PACKAGES_READ = "2026-11-17"
IMAGE_PACKAGES = frozenset(
    canonicalize_name(n)
    for n in """
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools
formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna
imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe
matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals
networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft
pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist
python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers
statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm
tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope
triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp
""".split()
)
"""The Python packages the GPU machine's image holds (/work/.library/device/KINDS.md, read on the date above)."""

PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)
MAX_BUNDLE_BYTES = 48 * 2**20
"""What travels to the GPU machine is at most 64 MiB, the working tree included: the bundle stays well under."""


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def marker_env(python_version: str) -> dict[str, str]:
    """The environment markers of CPython `python_version` on Linux x86-64, with no extras."""
    return {
        "python_version": python_version,
        "python_full_version": f"{python_version}.0",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": "x86_64",
        "os_name": "posix",
        "extra": "",
    }


def wheel_requirements(wheel: Path, python_version: str) -> list[Requirement]:
    """A wheel's own Requires-Dist that apply on the target (extras not chosen)."""
    with zipfile.ZipFile(wheel) as zf:
        meta = next(n for n in zf.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n))
        text = zf.read(meta).decode()
    env = marker_env(python_version)
    out = []
    for line in text.splitlines():
        if line.startswith("Requires-Dist:"):
            req = Requirement(line.split(":", 1)[1].strip())
            if req.marker is None or req.marker.evaluate(env):
                out.append(req)
    return out


def compatible(wheel_name: str, python_version: str) -> bool:
    """Whether a wheel file installs on CPython `python_version`, Linux x86-64 (manylinux)."""
    _, _, _, tags = parse_wheel_filename(wheel_name)
    cp = "cp" + python_version.replace(".", "")
    for tag in tags:
        py_ok = tag.interpreter in (cp, "py3", f"py{python_version.replace('.', '')}") or (
            tag.abi == "abi3" and tag.interpreter.startswith("cp3") and int(tag.interpreter[3:]) <= int(cp[3:])
        )
        abi_ok = tag.abi in ("none", "abi3", cp)
        plat_ok = tag.platform == "any" or (tag.platform.startswith("manylinux") and tag.platform.endswith("_x86_64"))
        if py_ok and abi_ok and plat_ok:
            return True
    return False


def find_cached(cache: Path, req: Requirement, python_version: str, pin: str | None) -> Path | None:
    for path in sorted(cache.glob("*.whl")):
        name, version, _, _ = parse_wheel_filename(path.name)
        if canonicalize_name(name) != canonicalize_name(req.name) or not compatible(path.name, python_version):
            continue
        if (pin is None or str(version) == pin) and req.specifier.contains(version, prereleases=True):
            return path
    return None


def download(cache: Path, req: Requirement, python_version: str, pin: str | None, log: list[str]) -> Path:
    """The wheel for `req` (at `pin` if given) from the cache, or downloaded into it with pip."""
    found = find_cached(cache, req, python_version, pin)
    if found:
        return found
    spec = f"{req.name}=={pin}" if pin else f"{req.name}{req.specifier}"
    if not pin:
        log.append(f"note: {req.name} is not pinned in gpu/bundle.py PINS; taking the newest {spec}")
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--no-deps"]
    cmd += ["--only-binary=:all:", "--python-version", python_version, "--implementation", "cp"]
    cmd += [arg for p in PLATFORMS for arg in ("--platform", p)]
    cmd += ["-d", str(cache), spec]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    found = find_cached(cache, req, python_version, pin)
    if proc.returncode != 0 or found is None:
        raise SystemExit(
            f"gpu-bundle: pip could not download {spec} for CPython {python_version}:\n{proc.stderr[-2000:]}"
        )
    return found


def pruned(name: str) -> bool:
    return name.startswith(RAY_PRUNE) or "/__pycache__/" in name


def pack_ray(wheel: Path, dest: Path, xz_level: int) -> dict[str, int]:
    """Ray's wheel as a .tar.xz of its files (site-packages layout) without RAY_PRUNE, its RECORD rewritten
    to list only what is kept. Members keep their permission bits (the raylet and GCS are executables)."""
    kept = removed = removed_bytes = unpacked = 0
    tmp = dest.with_suffix(".part")
    with zipfile.ZipFile(wheel) as zf, tarfile.open(tmp, "w:xz", preset=xz_level) as tar:  # type: ignore[call-overload]
        record = None
        for info in zf.infolist():
            if info.is_dir():
                continue
            if info.filename.endswith(".dist-info/RECORD"):
                record = info.filename
                continue
            if pruned(info.filename):
                removed += 1
                removed_bytes += info.file_size
                continue
            member = tarfile.TarInfo(info.filename)
            member.size = info.file_size
            member.mode = (info.external_attr >> 16) & 0o777 or 0o644
            member.mtime = int(time.mktime((*info.date_time, 0, 0, -1)))
            with zf.open(info) as f:
                tar.addfile(member, f)
            kept += 1
            unpacked += info.file_size
        if record is None:
            raise SystemExit(f"gpu-bundle: {wheel.name} has no RECORD")
        lines = [line for line in zf.read(record).decode().splitlines() if line and not pruned(line.split(",")[0])]
        data = ("\n".join(lines) + "\n").encode()
        member = tarfile.TarInfo(record)
        member.size, member.mode = len(data), 0o644
        tar.addfile(member, io.BytesIO(data))
    tmp.replace(dest)
    return {"files": kept, "unpacked_bytes": unpacked, "removed_files": removed, "removed_bytes": removed_bytes}


def build_mixtrain_wheel(dest_dir: Path) -> Path:
    """`pip wheel --no-deps` of a clean copy of the source tree (a stale build/ folder cannot leak in)."""
    with tempfile.TemporaryDirectory(prefix="mx-wheel-") as tmp:
        tree = Path(tmp) / "mixtrain"
        tree.mkdir()
        for name in ("pyproject.toml", "README.md", "LICENSE", "setup.cfg", "setup.py"):
            if (REPO / name).exists():
                shutil.copy2(REPO / name, tree / name)
        shutil.copytree(REPO / "src", tree / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "*.pyc"))
        out = Path(tmp) / "dist"
        base = [sys.executable, "-m", "pip", "wheel", "-q", "--disable-pip-version-check", "--no-deps", "-w", str(out)]
        proc = subprocess.run([*base, "--no-build-isolation", str(tree)], capture_output=True, text=True, check=False)
        if proc.returncode != 0:  # no setuptools here: let pip fetch the build backend
            proc = subprocess.run([*base, str(tree)], capture_output=True, text=True, check=False)
        wheels = list(out.glob("mixtrain-*.whl"))
        if proc.returncode != 0 or len(wheels) != 1:
            raise SystemExit(f"gpu-bundle: building mixtrain's wheel failed:\n{proc.stderr[-3000:]}")
        dest_dir.mkdir(parents=True, exist_ok=True)
        return Path(shutil.copy2(wheels[0], dest_dir / wheels[0].name))


def resolve(
    roots: Iterable[Requirement], ray_wheel: Path, wheel_cache: Path, python_version: str, log: list[str]
) -> dict[str, tuple[Path, str]]:
    """Walk the requirements from `roots`: those in the GPU image are taken as there, Ray is `ray_wheel`
    (its extras are not followed), every other one is downloaded and its own requirements walked."""
    todo = list(roots)
    seen: dict[str, tuple[Path, str]] = {}
    while todo:
        req = todo.pop(0)
        name = canonicalize_name(req.name)
        if name in seen or name in IMAGE_PACKAGES:
            continue
        if name == "ray":
            if req.extras:
                extras = ",".join(sorted(req.extras))
                log.append(f"note: mixtrain asks for ray[{extras}]: only Ray's own requirements are bundled")
            todo += wheel_requirements(ray_wheel, python_version)
            seen[name] = (ray_wheel, "mixtrain")
            continue
        wheel = download(wheel_cache, req, python_version, PINS.get(name), log)
        seen[name] = (wheel, str(req))
        todo += wheel_requirements(wheel, python_version)
    return seen


def build(out: Path, cache: Path, python_version: str, xz_level: int = 9) -> dict[str, Any]:
    t0 = time.perf_counter()
    log: list[str] = []
    cp = "cp" + python_version.replace(".", "")
    wheel_cache = cache / f"wheels-{cp}"
    wheel_cache.mkdir(parents=True, exist_ok=True)

    ray_req = Requirement(f"ray=={RAY_VERSION}")
    ray_wheel = download(wheel_cache, ray_req, python_version, RAY_VERSION, log)
    with tempfile.TemporaryDirectory(prefix="mx-bundle-") as tmp:
        mx_wheel = build_mixtrain_wheel(Path(tmp))
        deps = resolve(wheel_requirements(mx_wheel, python_version), ray_wheel, wheel_cache, python_version, log)

        prune_key = hashlib.sha256(("\n".join(RAY_PRUNE) + "v1").encode()).hexdigest()[:10]
        packed = cache / f"{ray_wheel.stem}-pruned-xz{xz_level}-{prune_key}.tar.xz"
        stats_file = packed.with_suffix(".json")
        if packed.exists() and stats_file.exists():
            ray_stats = json.loads(stats_file.read_text())
        else:
            ray_stats = pack_ray(ray_wheel, packed, xz_level)
            stats_file.write_text(json.dumps(ray_stats))

        if out.exists():
            if any(out.iterdir()) and not (out / "manifest.json").exists():
                raise SystemExit(f"gpu-bundle: {out} holds files that are not a bundle; not overwriting it")
            shutil.rmtree(out)
        (out / "wheels").mkdir(parents=True)
        ray_tar = out / f"ray-{RAY_VERSION}-{cp}-pruned.tar.xz"
        shutil.copy2(packed, ray_tar)
        wheels: list[dict[str, Any]] = [{"file": f"wheels/{mx_wheel.name}", "for": "mixtrain itself"}]
        shutil.copy2(mx_wheel, out / "wheels" / mx_wheel.name)
        for name, (wheel, why) in sorted(deps.items()):
            if name == "ray":
                continue
            shutil.copy2(wheel, out / "wheels" / wheel.name)
            wheels.append({"file": f"wheels/{wheel.name}", "for": why})

    files = [out / w["file"] for w in wheels] + [ray_tar]
    for w, path in zip(wheels, files):
        w.update(bytes=path.stat().st_size, sha256=sha256(path))
    total = sum(p.stat().st_size for p in files)
    manifest = {
        "schema": "mixtrain-gpu-bundle/1",
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "python_version": python_version,
        "platforms": list(PLATFORMS),
        "source_sha256": source_digest(REPO),
        "image_packages_read": IMAGE_PACKAGES_READ,
        "ray": {
            "version": RAY_VERSION,
            "wheel": ray_wheel.name,
            "wheel_bytes": ray_wheel.stat().st_size,
            "file": ray_tar.name,
            "bytes": ray_tar.stat().st_size,
            "sha256": sha256(ray_tar),
            "pruned": list(RAY_PRUNE),
            **ray_stats,
        },
        "wheels": wheels,
        "total_bytes": total,
        "build_seconds": round(time.perf_counter() - t0, 1),
        "notes": log,
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    if total > MAX_BUNDLE_BYTES:
        raise SystemExit(
            f"gpu-bundle: {total / 2**20:.1f} MiB is over {MAX_BUNDLE_BYTES / 2**20:.0f} MiB: it would not travel"
        )
    return manifest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="gpu-bundle", description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--python-version", default="3.12", help="target CPython X.Y (default 3.12: the GPU machine's)")
    ap.add_argument("--out", type=Path, default=REPO / ".gpu-bundle", help="bundle folder (default .gpu-bundle)")
    ap.add_argument("--cache", type=Path, default=REPO / ".gpu-cache", help="download cache (default .gpu-cache)")
    ap.add_argument(
        "--xz-level", type=int, default=9, choices=range(10), help="xz preset for Ray (default 9: smallest)"
    )
    args = ap.parse_args(argv)
    if not re.fullmatch(r"3\.\d+", args.python_version):
        ap.error(f"--python-version {args.python_version!r}: give CPython's X.Y, e.g. 3.12")
    m = build(args.out.resolve(), args.cache.resolve(), args.python_version, args.xz_level)
    print(f"gpu-bundle: {args.out} for CPython {m['python_version']} manylinux x86-64, {m['build_seconds']} s")
    r = m["ray"]
    print(
        f"  {r['file']:<52} {r['bytes'] / 2**20:6.1f} MiB  (wheel {r['wheel_bytes'] / 2**20:.1f} MiB; "
        f"{r['removed_files']} files, {r['removed_bytes'] / 2**20:.0f} MiB left out: {', '.join(r['pruned'])})"
    )
    for w in m["wheels"]:
        print(f"  {w['file']:<52} {w['bytes'] / 2**20:6.2f} MiB  ({w['for']})")
    print(f"  total {m['total_bytes'] / 2**20:.1f} MiB")
    for note in m["notes"]:
        print(f"  {note}")
    print("  on the GPU machine: make gpu-check  (carry .gpu-bundle; the report goes to $OUT)")
    return 0


if __name__ == "__main__":
    os.chdir(REPO)
    sys.exit(main())
