#!/usr/bin/env bash
# The wheels a GPU machine without a package index needs beside its image's packages, so that the README's
# resolving installs (`pip install -e ".[gpu]"`, `pip install -e ".[test]"`) run verbatim there with
# PIP_NO_INDEX=1 PIP_FIND_LINKS=$PWD/.whl in the environment. Run here (with an index), from the repo root, in
# the environment the README's CPU command built (CI's): it takes the versions installed here, which passed CI,
# for the whole dependency closure of `.[gpu,test]`, and downloads each as a python 3.12 manylinux x86_64 wheel
# into .whl/ (git-ignored; the device carry limit is 64 MiB, this stays under about 55).
#
# Left out, because the GPU image has them (docs/testing.md): torch, triton and the CUDA wheels (nvidia-*, but
# nvidia-ml-py), and the big compiled wheels that a CUDA torch + transformers image ships and that were on the
# image in the 2026-12-01 run (benchmarks/results/gpu_demo.md): numpy, pandas, pyarrow, matplotlib and its
# compiled deps, scipy (on the image too: its tau_ci_coverage smoke passed there, 2026-12-03), tokenizers, hf-xet,
# sympy; and the dependencies of torch, transformers (5.17 there satisfies our >=5.15; our tests pass on it), its
# serving extra and aiohttp, which that run's install found on the image.
# Pinned where the image's own versions conflict with ours (pip's error there): packaging<26 (snakemake 9.27.1)
# and fsspec<=2026.6.0 (datasets 5.0.1, which dflash 0.1.0 pins): both are in the closure at versions that fit.
# Usage: .ci/gpu_wheels.sh [DEST]   (DEST defaults to .whl)
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${1:-.whl}
mkdir -p "$dest"
python - > "$dest/requirements.txt" <<'EOF'
"""The installed closure of this checkout's dependencies and its gpu and test extras, as name==version lines."""
import re
import sys
import tomllib
from importlib.metadata import PackageNotFoundError, distribution

from packaging.requirements import Requirement

SKIP = re.compile(r"^(torch|triton|nvidia-(?!ml-py).*|cuda-.*|numpy|pandas|pyarrow|matplotlib|contourpy|fonttools"
                  r"|kiwisolver|pillow|scipy|cycler|pyparsing|python-dateutil|six|tokenizers|hf-xet|sympy|mpmath|networkx"
                  r"|jinja2|markupsafe|typing-extensions|filelock|transformers|huggingface-hub|safetensors|regex|pyyaml"
                  r"|accelerate|psutil|typer|rich|markdown-it-py|mdurl|pygments|shellingham|click|certifi|idna"
                  r"|charset-normalizer|urllib3|h11|httpcore|httpx|anyio|aiohttp|aiosignal|aiohappyeyeballs|attrs"
                  r"|frozenlist|multidict|propcache|yarl)$")
MARKERS = {"python_version": "3.12", "python_full_version": "3.12.0", "sys_platform": "linux",
           "platform_machine": "x86_64", "platform_system": "Linux", "implementation_name": "cpython",
           "platform_python_implementation": "CPython", "os_name": "posix"}
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
wanted = [*project["dependencies"], *project["optional-dependencies"]["gpu"], *project["optional-dependencies"]["test"]]
todo, seen, pinned = [Requirement(r) for r in wanted], {}, []
while todo:
    req = todo.pop()
    name = re.sub(r"[-_.]+", "-", req.name).lower()
    extras = seen.get(name, set()) | set(req.extras)
    if name in seen and extras == seen[name]:
        continue
    seen[name] = extras
    try:
        dist = distribution(req.name)
    except PackageNotFoundError:  # the gpu extra is not installed on a CPU machine: take its pin
        if not str(req.specifier).startswith("=="):
            sys.exit(f"gpu_wheels: {req} is not installed here and not pinned; install it or pin it in pyproject.toml")
        pinned.append(f"{name}{req.specifier}")
        continue
    version = dist.version.split("+")[0]
    if not req.specifier.contains(version, prereleases=True):
        sys.exit(f"gpu_wheels: installed {name} {version} does not satisfy {req}; reinstall: pip install -e '.[test]'")
    pinned.append(f"{name}=={version}")
    for r in map(Requirement, dist.requires or []):
        if r.marker is None or any(r.marker.evaluate({**MARKERS, "extra": x}) for x in (extras or {""})):
            todo.append(r)
print("\n".join(sorted(p for p in set(pinned) if not SKIP.match(p.split("=")[0]))))
EOF
echo "gpu_wheels: $(wc -l < "$dest/requirements.txt") wheels -> $dest/"
# --no-deps (the closure is already listed) also lets a package that has no wheel come as an sdist (connection-pool
# 0.0.3): built into a wheel below, since the GPU machine builds nothing but our own package.
pip download --no-deps --prefer-binary --python-version 3.12 --implementation cp --abi cp312 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_24_x86_64 \
    -d "$dest" -r "$dest/requirements.txt" -q
for sdist in "$dest"/*.tar.gz "$dest"/*.zip; do
    [ -e "$sdist" ] || continue
    pip wheel --no-deps -q -w "$dest" "$sdist" && rm "$sdist"
done
size=$(du -sm "$dest" | cut -f1)
echo "gpu_wheels: $(ls "$dest"/*.whl | wc -l) wheel files, ${size} MiB in $dest"
if [ "$size" -gt 55 ]; then echo "gpu_wheels: over 55 MiB (the device carry limit is 64 MiB)" >&2; exit 1; fi
