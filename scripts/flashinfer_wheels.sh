#!/usr/bin/env bash
# Fetch FlashInfer 0.7.4 and what its GDN kernels import, for a GPU machine without internet, into .whl-fi/:
#   .whl-fi/wheels/   the wheels as PyPI has them (pinned, --no-deps, for the GPU image's Python and Linux x86_64)
#   .whl-fi/site/     them unpacked as one prefix (what 'pip install --target' lays out), trimmed (below)
#   .whl-fi/p1/, p2/  .whl-fi/site as one tar.xz split in parts of at most PART_MB MiB: one part per device call
#   .whl-fi/MANIFEST.txt  every wheel, its size, and what was dropped
#
#   bash scripts/flashinfer_wheels.sh [PYTHON_VERSION]      (default 3.12: the GPU image's python3 -V)
#
# The GDN path (flashinfer/__init__ + flashinfer.gdn_decode + flashinfer/gdn_kernels) imports, besides torch and
# numpy: nvidia-cutlass-dsl (CuTe DSL: its python packages, the cu13 MLIR library and runtime), apache-tvm-ffi,
# cuda-bindings / cuda-pathfinder (cuda-python), cuda-tile, nvidia-cudnn-frontend, nvidia-ml-py, requests (and
# its four dependencies), protobuf, tabulate, einops, click, tqdm, packaging.  Not fetched, because nothing on that
# path imports them: nccl4py, nccl-extensions, cuda-core, ninja (flashinfer's nvcc JIT only).
# Trimmed, because only flashinfer's nvcc JIT reads them and the GDN kernels are CuTe DSL: flashinfer/data/
# (csrc, cutlass and cccl headers), and the CUDA/C++ kernel sources and templates of flashinfer's other kernels
# (*.cu *.cuh *.h *.hpp *.inl *.cpp *.cc *.c *.ptx *.jinja *.inc); every .py file stays, so `import flashinfer`
# works as shipped.  From nvidia-cutlass-dsl: its aarch64/QNX stub libraries and the iket profiler package
# (never imported).  Needs network (PyPI), xz, about 2 GB of disk and several minutes (xz of ~400 MB).
set -euo pipefail
cd "$(dirname "$0")/.."
PYV=${1:-3.12}
PY=${PYTHON:-python3}
PART_MB=${PART_MB:-50}
OUT=.whl-fi
PINS=(
    flashinfer-python==0.7.4
    nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 nvidia-cutlass-dsl-libs-core==4.8.1
    nvidia-cutlass-dsl-libs-cu13==4.8.1
    apache-tvm-ffi==0.1.15.post2 cuda-python==13.4.4 cuda-bindings==13.4.4 cuda-pathfinder==1.9.1 cuda-tile==1.7.0
    nvidia-cudnn-frontend==1.32.0 nvidia-ml-py==13.615.71 protobuf==7.36.2
    requests==2.34.2 urllib3==2.8.0 certifi==2026.10.19.post1 charset-normalizer==3.5.3 idna==3.21
    tabulate==0.10.0 einops==0.8.2 click==8.5.1 tqdm==4.70.1 packaging==26.4
)
mkdir -p "$OUT/wheels"
plat=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
         manylinux_2_5_x86_64 manylinux1_x86_64; do plat+=(--platform "$p"); done
echo "[flashinfer_wheels] downloading ${#PINS[@]} wheels for Python $PYV (linux x86_64) into $OUT/wheels"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" "${plat[@]}" -d "$OUT/wheels" "${PINS[@]}"

rm -rf "$OUT/site" "$OUT/p"[0-9]*
"$PY" - "$OUT" "${PINS[@]}" <<'EOF'
import re, sys, zipfile
from pathlib import Path

out = Path(sys.argv[1]); site = out / "site"; site.mkdir()
wheels = sorted((out / "wheels").glob("*.whl"))
want = {re.sub(r"[-_.]+", "_", p.split("==")[0]).lower(): p.split("==")[1] for p in sys.argv[2:]}
SRC = (".cu", ".cuh", ".h", ".hpp", ".inl", ".cpp", ".cc", ".c", ".ptx", ".jinja", ".inc")

def dropped(name: str) -> bool:
    if name.startswith("flashinfer/"):
        return name.startswith("flashinfer/data/") or name.endswith(SRC)
    if name.startswith("nvidia_cutlass_dsl/"):
        return "/lib/stubs/" in name or name.startswith("nvidia_cutlass_dsl/dsl_packages/iket/")
    return False

lines, kept_total, drop_total = [], 0, 0
for w in wheels:
    dist, ver = w.name.split("-")[:2]
    if want.get(dist.lower()) != ver:
        continue  # an older download of another version in the cache folder
    with zipfile.ZipFile(w) as z:
        kept = drop = nd = 0
        for info in z.infolist():
            if info.is_dir():
                continue
            if dropped(info.filename):
                drop += info.file_size; nd += 1
                continue
            z.extract(info, site)
            kept += info.file_size
    kept_total += kept; drop_total += drop
    lines.append(f"{w.name}\twheel {w.stat().st_size / 2**20:.1f} MiB\tkept {kept / 2**20:.1f} MiB unpacked"
                 + (f"\tdropped {nd} files, {drop / 2**20:.1f} MiB" if nd else ""))
missing = sorted(set(want) - {w.name.split("-")[0].lower() for w in wheels})
if missing:
    sys.exit(f"[flashinfer_wheels] not downloaded: {missing}")
lines.append(f"total kept {kept_total / 2**20:.1f} MiB unpacked, dropped {drop_total / 2**20:.1f} MiB")
(out / "MANIFEST.txt").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
echo "[flashinfer_wheels] compressing $OUT/site (xz -9, a few minutes)"
tar -C "$OUT" -cf - site | xz -T0 -9 > "$OUT/site.tar.xz"
split -b "${PART_MB}m" -d -a 1 "$OUT/site.tar.xz" "$OUT/site.tar.xz.part"
rm "$OUT/site.tar.xz"
i=1
for part in "$OUT"/site.tar.xz.part*; do
    mkdir -p "$OUT/p$i"
    mv "$part" "$OUT/p$i/"
    i=$((i + 1))
done
sha256sum "$OUT"/p*/site.tar.xz.part* | tee "$OUT/SHA256SUMS"
du -sh "$OUT"/p*
echo "[flashinfer_wheels] carry each of $(ls -d "$OUT"/p* | tr '\n' ' ')in its own device call (FLASHINFER_RUN.md)"
