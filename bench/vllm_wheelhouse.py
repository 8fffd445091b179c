"""A wheelhouse of vLLM and what an offline machine lacks for it (docs/gpu.md, "vLLM on an offline
GPU machine"). Run it where the package index is reachable; copy the result to the target.

    # on the target: what it has (versions pinned)
    python3 -m pip list --format=freeze > target-have.txt
    # here: resolve for the target's Python and platform, keeping what it has where vLLM accepts it
    python bench/vllm_wheelhouse.py --have target-have.txt --python 3.12 \\
        --platform manylinux_2_35_x86_64 [--vllm 0.26.0] [--out wheelhouse] [--list-only] [--part-mib 60]
    # on the target
    python3 -m pip install --no-index --no-deps --target /tmp/site -r wheelhouse/requirements.txt \\
        --find-links wheelhouse

Resolution: ``uv pip install --dry-run --target FAKE`` (uv from PyPI: ``pip install uv``), where
FAKE holds a metadata-only ``.dist-info`` for every package of ``--have``. Why uv and fakes: uv
evaluates environment markers and Requires-Python for the *target's* Python (pip evaluates markers
with its own interpreter, so a 3.11 machine preparing for 3.12 would miss ``six; python_version >
"3.11"``), and a package that counts as installed is kept when its version satisfies vLLM and is
never descended into (torch's nvidia-* libraries are not fetched again); one that does not
satisfy it is replaced (vLLM 0.26 on numpy 2.5: numpy 2.3.5 for mistral-common's ``numpy<2.4``).

Download: ``pip download --no-deps --only-binary=:all:`` of the resolved pins for the target's
tags. ``--list-only`` asks pip which file each pin would be (``--dry-run --report``, metadata only)
and the index for each file's size, and downloads nothing.

``--part-mib N``: the wheelhouse also as a tar stream cut into parts of at most N MiB
(``wheelhouse.tar.000`` ...; a wheel larger than N spans parts), with their sha256 sums. Join:
``mkdir wheelhouse && cat wheelhouse.tar.[0-9]* | tar xf - -C wheelhouse``.

``--platform`` is the target's glibc: manylinux_2_28 is too old for vLLM 0.26 (llguidance 1.7
ships only manylinux_2_31 wheels); read it there with ``python3 -c "import platform;
print(platform.libc_ver())"``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
from pathlib import Path

PIN = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*==\s*([^\s;#]+)")
# uv's dry-run lines: " + name==version" (to install), " - name==version" (an installed one replaced)
UV_LINE = re.compile(r"^ ([+-]) ([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)")
MANYLINUX = re.compile(r"^manylinux_2_(\d+)_(\w+)$")


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_have(paths: list[str]) -> dict[str, str]:
    """{normalized name: version} from ``pip freeze`` / ``pip list --format=freeze`` files (lines
    without ``==``, e.g. ``name @ file://...``, cannot stand for a version and are skipped)."""
    have = {}
    for path in paths:
        for line in Path(path).read_text().splitlines():
            match = PIN.match(line)
            if match:
                have[normalize(match[1])] = match[2]
    return have


def pip_platforms(platform: str) -> list[str]:
    """pip's ``--platform`` values for a target: pip does not widen manylinux_2_N to older glibc
    versions itself, so every manylinux_2_M (M <= N) and the legacy aliases are listed."""
    match = MANYLINUX.match(platform)
    if match is None:
        return [platform]
    top, arch = int(match[1]), match[2]
    legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
    out = [f"manylinux_2_{m}_{arch}" for m in range(top, 4, -1)]
    return out + [f"{legacy[m]}_{arch}" for m in sorted(legacy, reverse=True) if m <= top]


def uv_platform(platform: str) -> str:
    """uv's ``--python-platform`` triple for a wheel platform tag (manylinux_2_35_x86_64 ->
    x86_64-manylinux_2_35)."""
    match = MANYLINUX.match(platform)
    if match is None:
        raise SystemExit(f"--platform {platform}: give a manylinux_2_N_ARCH tag (the target's glibc)")
    return f"{match[2]}-manylinux_2_{match[1]}"


def uv_command() -> list[str]:
    if shutil.which("uv"):
        return ["uv"]
    probe = subprocess.run([sys.executable, "-m", "uv", "--version"], capture_output=True)
    if probe.returncode == 0:
        return [sys.executable, "-m", "uv"]
    raise SystemExit("uv is needed to resolve for another Python version: pip install uv")


def resolve(requirements: list[str], have: dict[str, str], python: str, platform: str,
            index_url: str | None) -> tuple[dict[str, str], dict[str, str]]:
    """(to fetch {name: version}, replaced {name: the target's version}) for ``requirements`` on a
    target that has ``have``."""
    with tempfile.TemporaryDirectory() as fake:
        for name, version in have.items():
            info = Path(fake) / f"{name.replace('-', '_')}-{version}.dist-info"
            info.mkdir()
            # no Requires-Dist: what the target has is taken as complete, never descended into
            (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
            (info / "RECORD").write_text("")
            (info / "INSTALLER").write_text("easyvlm-wheelhouse\n")
        cmd = uv_command() + ["pip", "install", "--dry-run", "--target", fake, "--python-version", python,
                              "--python-platform", uv_platform(platform), "--only-binary", ":all:", *requirements]
        if index_url:
            cmd += ["--index-url", index_url]
        run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode != 0:
        raise SystemExit(f"resolution failed ({' '.join(cmd[:3])} ...):\n{run.stderr}")
    fetch, replaced = {}, {}
    for line in (run.stdout + run.stderr).splitlines():
        match = UV_LINE.match(line)
        if match:
            (fetch if match[1] == "+" else replaced)[normalize(match[2])] = match[3]
    return fetch, replaced


def pip_flags(python: str, platform: str, index_url: str | None) -> list[str]:
    flags = ["--no-deps", "--only-binary=:all:", "--python-version", python, "--implementation", "cp"]
    for p in pip_platforms(platform):
        flags += ["--platform", p]
    return flags + (["--index-url", index_url] if index_url else [])


def planned_files(pins: list[str], flags: list[str]) -> list[tuple[str, int]]:
    """(file name, bytes) of the wheel pip would download for each pin: pip's own choice
    (``--dry-run --report`` reads only metadata), each file's size from the index (HEAD)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--dry-run", "--ignore-installed",
                        "--target", str(Path(tmp) / "t"), "--report", str(report), *flags, *pins], check=True)
        items = json.loads(report.read_text())["install"]
    out = []
    for item in items:
        url = item["download_info"]["url"]
        with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=60) as response:
            out.append((url.rsplit("/", 1)[-1], int(response.headers["Content-Length"])))
    return out


class _Parts:
    """A write-only file that cuts what is written into ``prefix.000``, ``prefix.001`` ... of at most
    ``size`` bytes each (so that a tar stream can be copied in pieces and joined with ``cat``)."""

    def __init__(self, prefix: Path, size: int):
        self.prefix, self.size, self.paths, self.file, self.left = prefix, size, [], None, 0

    def write(self, data: bytes) -> int:
        view = memoryview(data)
        while view:
            if self.left == 0:
                self.close()
                self.paths.append(self.prefix.with_name(f"{self.prefix.name}.{len(self.paths):03d}"))
                self.file, self.left = open(self.paths[-1], "wb"), self.size
            n = min(self.left, len(view))
            self.file.write(view[:n])
            view, self.left = view[n:], self.left - n
        return len(data)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


def split_wheelhouse(wheelhouse: Path, part_mib: int) -> list[Path]:
    """The wheelhouse as an uncompressed tar stream (wheels are zip files already) in parts of at
    most ``part_mib`` MiB beside it, plus ``SHA256SUMS`` of the parts."""
    parts = _Parts(wheelhouse.parent / f"{wheelhouse.name}.tar", part_mib * 2**20)
    with tarfile.open(fileobj=parts, mode="w|") as tar:
        for path in sorted(wheelhouse.iterdir()):
            tar.add(path, arcname=path.name)
    parts.close()
    sums = [f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.name}" for p in parts.paths]
    (wheelhouse.parent / f"{wheelhouse.name}.tar.SHA256SUMS").write_text("\n".join(sums) + "\n")
    return parts.paths


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm", default="0.26.0", help="vLLM version (0.26.0: its CUDA wheel pins torch 2.11.0)")
    ap.add_argument("--have", action="append", default=[], required=True,
                    help="the target's `pip list --format=freeze` (repeatable); these are not downloaded")
    ap.add_argument("--python", default="3.12", help="the target's Python version")
    ap.add_argument("--platform", default="manylinux_2_35_x86_64", help="the target's manylinux tag (its glibc)")
    ap.add_argument("--extra", action="append", default=[], help="another requirement to add (repeatable)")
    ap.add_argument("--exclude", action="append", default=[],
                    help="a resolved package to leave out (repeatable; vLLM may need it at run time)")
    ap.add_argument("--out", default="wheelhouse", help="the wheelhouse directory")
    ap.add_argument("--part-mib", type=int, default=0, help="also cut the wheelhouse into tar parts of this size")
    ap.add_argument("--index-url", help="an index other than uv's and pip's default")
    ap.add_argument("--list-only", action="store_true", help="print what would be downloaded and its size, download nothing")
    args = ap.parse_args(argv)

    have = read_have(args.have)
    fetch, replaced = resolve([f"vllm=={args.vllm}", *args.extra], have, args.python, args.platform, args.index_url)
    for name in map(normalize, args.exclude):
        fetch.pop(name, None)
    pins = [f"{name}=={version}" for name, version in sorted(fetch.items())]
    for name, version in sorted(replaced.items()):
        print(f"replaces the target's {name}=={version} with {name}=={fetch.get(name, '?')}")
    flags = pip_flags(args.python, args.platform, args.index_url)
    if args.list_only:
        files = planned_files(pins, flags)
        for file_name, size in sorted(files, key=lambda f: -f[1]):
            print(f"{size / 2**20:9.1f} MiB  {file_name}")
        print(f"{len(files)} wheels, {sum(s for _, s in files) / 2**20:.0f} MiB (vllm=={args.vllm}, target "
              f"Python {args.python} {args.platform}, {len(have)} packages there)")
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "-d", str(out), *flags, *pins], check=True)
    # what to install there, pinned: `pip install --no-index --no-deps --find-links DIR -r DIR/requirements.txt`
    (out / "requirements.txt").write_text("\n".join(pins) + "\n")
    wheels = sorted(out.glob("*.whl"))
    print(f"{out}: {len(wheels)} wheels, {sum(w.stat().st_size for w in wheels) / 2**20:.0f} MiB")
    if len(wheels) != len(pins):
        raise SystemExit(f"{len(pins)} pins but {len(wheels)} wheels in {out} (left over from another run?)")
    if args.part_mib:
        parts = split_wheelhouse(out, args.part_mib)
        print(f"{len(parts)} parts of at most {args.part_mib} MiB: {parts[0].name} ... {parts[-1].name}; join: "
              f"mkdir {out.name} && cat {out.name}.tar.[0-9]* | tar xf - -C {out.name}")


if __name__ == "__main__":
    main()
